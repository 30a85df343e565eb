"""Fill-in-the-middle for ``/v1/completions`` ``suffix``: the prompt and the suffix around the model's own FIM
tokens (prefix, suffix, middle: the PSM order StarCoder, Qwen2.5-Coder and DeepSeek-Coder were trained on), so
the model writes what goes between them. A model whose vocabulary has no FIM tokens refuses ``suffix`` with a
400 saying so, never an answer that ignores it."""

from __future__ import annotations

from app.api.errors import APIError

# Each family's (prefix, suffix, middle) tokens, as their tokenizers spell them.
FIM_TOKENS = [
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, SantaCoder
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
]


def fim_tokens(tokenizer) -> tuple[str, str, str] | None:
    """The model's FIM tokens: the first family whose three are each one token of its vocabulary, or None."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for family in FIM_TOKENS:
        if all(token in vocab for token in family):
            return family
    return None


def fim_prompt(tokenizer, prompt, suffix: str, model_name: str) -> str:
    """The text to complete for ``prompt`` + (generated) + ``suffix``."""
    family = fim_tokens(tokenizer)
    if family is None:
        raise APIError(400, f"model {model_name!r} has no fill-in-the-middle tokens, so suffix cannot be honoured; "
                       "send the prompt alone", param="suffix", code="unsupported_parameter")
    if not isinstance(prompt, str):
        raise APIError(400, "suffix needs the prompt as one string", param="prompt")
    begin, hole, end = family
    return f"{begin}{prompt}{hole}{suffix}{end}"
