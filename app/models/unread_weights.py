"""What a load left unread: transformers fills a weight the checkpoint lacks with random values, and loads a quantized
checkpoint's codes as plain weights where its config.json names no quantization, and goes on either way. Both are
refused at load, naming what is missing, rather than served as noise."""

from __future__ import annotations

# Tensors that only a quantized checkpoint holds beside its weights (fp8's and compressed-tensors' scales, bitsandbytes'
# int8 and 4-bit states, AWQ's and GPTQ's packing): left unread, the weights they scale are served as raw codes.
GPTQ_TENSORS = (".qweight", ".qzeros", ".scales", ".g_idx")
QUANTIZATION_TENSORS = (".weight_scale", ".weight_scale_inv", ".input_scale", ".weight_zero_point", ".weight_packed",
                        ".SCB", ".weight_format", ".absmax", ".quant_map", *GPTQ_TENSORS)


def unread_weights(loading: dict, quantization: str = "none") -> str | None:
    """Why ``from_pretrained``'s loading info (``output_loading_info``) means the model would not compute the
    checkpoint's numbers, or None: weights it lacks (a quantized ``lm_head`` transformers cannot read, an older GPTQ
    layout read as a plain checkpoint, GPTQ layers under names transformers' modules have not), or quantization
    tensors it did not read."""
    missing = sorted(loading.get("missing_keys") or [])
    unexpected = sorted(loading.get("unexpected_keys") or [])
    if not missing:
        return _unread_quantization(unexpected)
    quantized = [key for key in unexpected if key.endswith(GPTQ_TENSORS)]
    packed = sorted({key.rsplit(".", 1)[-1] for key in quantized})
    hint = (f"; the checkpoint holds quantized tensors ({', '.join(packed)}) that this load did not read: a GPTQ checkpoint "
            "needs model.quantization: gptq and a quantization_config in its config.json (AutoGPTQ's older "
            "quantize_config.json alone is not read), and a quantized lm_head is not supported") if packed else ""
    if quantized and quantization == "gptq":  # read as GPTQ, yet its layers are not where transformers' modules are
        hint = (f"; its GPTQ layers are named as transformers' modules for this architecture are not (e.g. {quantized[0]}): "
                "GPTQModel writes some architectures' layers apart (MoE experts one by one, Phi-3's gate_up_proj in "
                "two) where transformers fuses them, so this checkpoint cannot be served; serve the unquantized model")
    shown = ", ".join(missing[:4]) + (f" (and {len(missing) - 4} more)" if len(missing) > 4 else "")
    return f"the checkpoint has no values for {shown}, which transformers would fill with random numbers{hint}"


def _unread_quantization(unexpected: list[str]) -> str | None:
    """Every weight present, yet tensors only a quantized checkpoint holds left unread: its config.json names no
    quantization (an older checkpoint's, or one stripped of it), and its codes would be served as weights."""
    found = [key for key in unexpected if key.endswith(QUANTIZATION_TENSORS) or ".quant_state." in key]
    if not found:
        return None
    return (f"the checkpoint holds quantization tensors this load did not read (e.g. {found[0]}, {len(found)} in all), "
            "so its weights would be served as raw codes; its config.json needs the quantization_config it was saved "
            "with (a quantized checkpoint this server loads: GPTQ, with model.quantization: gptq)")
