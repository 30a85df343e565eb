"""Whether a checkpoint's layers are ones the paged engine runs: read off its config alone, before any weight loads."""

from __future__ import annotations


class UnsupportedArchitectureError(ValueError):
    """The model's layers are of a kind the paged engine does not run (the message names it)."""


ATTENTION_LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


def architecture_name(model_config) -> str:
    """The checkpoint's architecture as its config names it (else the config's class)."""
    return (getattr(model_config, "architectures", None) or [type(model_config).__name__])[0]


def require_attention_decoder(model_config) -> None:
    """Refuse, naming it, an architecture whose KV the paged pool cannot hold: layers that are not attention (linear
    attention, convolutions, state-space layers), or keys and values of different sizes (latent attention)."""
    name = architecture_name(model_config)
    kinds = list(getattr(model_config, "layer_types", None) or [])
    others = [i for i, kind in enumerate(kinds) if kind not in ATTENTION_LAYER_KINDS]
    if others:
        names = " and ".join(sorted({kinds[i] for i in others}))
        raise UnsupportedArchitectureError(f"{name} cannot be served: it has {names} layers (layer {', '.join(map(str, others[:8]))}), "
                                           "not attention; the paged engine serves decoders whose every layer attends")
    if getattr(model_config, "kv_lora_rank", None):
        raise UnsupportedArchitectureError(f"{name} cannot be served: it uses multi-head latent attention (kv_lora_rank, as "
                                           "DeepSeek-V2/V3 do), keys and values of different sizes, which the paged KV pool does not hold")
    missing = [key for key in ("num_attention_heads", "num_hidden_layers") if not isinstance(getattr(model_config, key, None), int)]
    if missing:  # RWKV and other recurrent models state no attention heads
        raise UnsupportedArchitectureError(f"{name} cannot be served: its config states no {' or '.join(missing)}; the paged "
                                           "engine serves decoders of attention layers")
