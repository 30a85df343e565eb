"""LLM serving core: configs, model loading, engine and OpenAI protocol. Never imports ray."""
