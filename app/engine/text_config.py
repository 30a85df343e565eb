"""The language model's config inside a checkpoint's: a multimodal checkpoint (Gemma 3 from 4B, Mistral Small 3.1,
Qwen2.5-VL) keeps its decoder's fields under ``text_config``, as vLLM's ``hf_text_config`` reads them."""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    """``config``'s decoder part (transformers' ``get_text_config``), or ``config`` itself for a text model."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config
