"""How long a context the engine serves exactly as transformers computes it, for architectures whose layers depend on
a token's absolute position in ways a batched, chunked engine step does not reproduce past some length.

transformers decides some things once per forward pass, from the pass's largest position: Phi-3's ``longrope`` takes
the long factors for every token of a pass once any position is past ``original_max_position_embeddings``. The engine
runs many requests, and a long prompt's chunks, in one packed pass, so a batch-mate (or the prompt's own later chunk)
would decide for a token that transformers computes with the short factors. Llama 4's chunked local attention exists
only in transformers' attention mask, and its query temperature tuning reads the position within the pass. Below each
limit none of this differs (short factors throughout; one chunk; a scale of exactly 1), so the model is served up to
it: the context is capped there, or a longer ``max_model_len`` asked for is refused, naming why.
"""

from __future__ import annotations

from typing import Any


def exact_context_limit(config: Any) -> tuple[int, str] | None:
    """(the longest context served exactly, why), or None where the architecture has no such limit."""
    limits = [limit for limit in (_longrope(config), _chunked_attention(config), _temperature_tuning(config)) if limit]
    return min(limits) if limits else None


def _rope_parameters(config: Any) -> list[dict]:
    """The rope settings, one dict, or one per layer type (Gemma 3: {"full_attention": {...}, ...})."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope and all(isinstance(value, dict) for value in rope.values()):
        return list(rope.values())
    return [rope] if isinstance(rope, dict) else []


def _longrope(config: Any) -> tuple[int, str] | None:
    for rope in _rope_parameters(config):
        if (rope.get("rope_type") or rope.get("type")) == "longrope":
            original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
            if original:
                return int(original), (f"longrope takes its long factors for a whole forward pass once any position passes "
                                       f"{int(original)}, which a batched engine step cannot reproduce per request")
    return None


def _chunked_attention(config: Any) -> tuple[int, str] | None:
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk:
        return int(chunk), f"chunked local attention (chunks of {int(chunk)} tokens) is not implemented by the paged engine"
    return None


def _temperature_tuning(config: Any) -> tuple[int, str] | None:
    floor_scale = getattr(config, "floor_scale", None)
    if getattr(config, "attn_temperature_tuning", False) and floor_scale:
        return int(floor_scale) - 1, (f"query temperature tuning scales queries from position {int(floor_scale) - 1} on, "
                                      "by positions the engine's packed steps do not give it")
    return None


def rope_scaled_context(config: Any, native: int | None) -> tuple[int, str] | None:
    """(the context a YaRN rope scaling extends the model to, how), where that is past ``max_position_embeddings``.

    transformers computes YaRN's frequencies once from the config (static), so every position up to
    ``original_max_position_embeddings x factor`` is computed the same in any pass: the context vLLM derives too
    (Qwen2.5/Qwen3's long-context setting adds it to config.json). Dynamic NTK recomputes its frequencies from a pass's
    largest position, which a packed step does not reproduce per request: no extension. Linear scaling is not
    extended either: some checkpoints' ``max_position_embeddings`` already counts its factor (Gemma 3)."""
    ropes = _rope_parameters(config)
    kinds = [rope.get("rope_type") or rope.get("type") for rope in ropes]
    if native is None or "dynamic" in kinds or "longrope" in kinds:
        return None
    best = None
    for kind, rope in zip(kinds, ropes):
        original = int(rope.get("original_max_position_embeddings") or native)
        if kind == "yarn" and rope.get("factor") and int(original * rope["factor"]) > (best or (native, ""))[0]:
            best = int(original * rope["factor"]), f"YaRN rope scaling, factor {rope['factor']:g} over {original} positions"
    return best


def asked_past_stated_context(config: Any, native: int) -> tuple[int | None, str] | None:
    """For a ``max_model_len`` asked for past the stated context ``native``: (the longest one taken, or None for none,
    why), where the rope scaling decides it.

    Linear scaling's frequencies are fixed (transformers computes every position the same in any pass), so a context up
    to ``native x factor`` is served exactly; it is taken only when asked for, since checkpoints differ on whether
    ``max_position_embeddings`` already counts the factor (Gemma 3's and DeepSeek-Coder's do, LongChat's does not).
    Dynamic NTK recomputes its frequencies from a pass's largest position once past ``native``: none is taken."""
    kinds = {(rope.get("rope_type") or rope.get("type")): rope for rope in _rope_parameters(config)}
    if "dynamic" in kinds:
        return None, (f"dynamic NTK rope scaling recomputes its frequencies from a forward pass's largest position past "
                      f"{native}, which a batched engine step cannot reproduce per request")
    factor = (kinds.get("linear") or {}).get("factor")
    if factor and factor > 1:
        return int(native * factor), (f"linear rope scaling, factor {factor:g}: up to {int(native * factor)} is served "
                                      f"exactly, if this checkpoint's max_position_embeddings does not count the factor")
    return None


def packed_step_limit(config: Any) -> tuple[int, str] | None:
    """The most tokens one engine step may pack for this architecture (its layers read positions within the pass)."""
    return _temperature_tuning(config)
