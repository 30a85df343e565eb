"""OpenAI-compatible protocol: request models, errors, and the serving logic over an engine."""
