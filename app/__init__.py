"""LLM serving core: configs, model loading, engine and OpenAI protocol. Never imports ray."""

from app.quiet import silence_known_noise

silence_known_noise()
