"""Load-time quantization: which ``from_pretrained`` arguments each method needs, and the checks that
make a bad choice fail at start with a message that says what to do.

- ``bnb-int8`` / ``bnb-nf4``: bitsandbytes quantizes a full-precision checkpoint while it loads.
- ``gptq``: the checkpoint is already GPTQ-quantized (``python -m app quantize`` writes one); its
  ``config.json`` carries ``quantization_config`` and transformers loads it with GPTQModel's kernels.

Either way the model stays an unmodified transformers model whose Linear layers are replaced by the
library's quantized ones, so the engine's paged attention runs it exactly as it runs bf16.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("none", "bnb-int8", "bnb-nf4", "gptq")


class QuantizationError(RuntimeError):
    """A quantization setting cannot work with this model or platform; the message says what to do."""


def from_pretrained_kwargs(method: str, path: str, dtype: torch.dtype, device: torch.device, hub_kwargs: dict) -> dict[str, Any]:
    """Extra ``from_pretrained`` arguments for ``method`` after checking it can work here."""
    existing = checkpoint_quantization(path, hub_kwargs)
    if method == "none":
        if existing:
            raise QuantizationError(_prequantized_advice(existing))
        return {}
    if method == "gptq":
        return _gptq_kwargs(existing, device)
    if existing:
        raise QuantizationError(
            f"{method} quantizes a full-precision checkpoint, but this one is already quantized "
            f"({existing.get('quant_method')}); point model.source at the unquantized model"
        )
    return {"quantization_config": _bnb_config(method, dtype, device)}


def checkpoint_quantization(path: str, hub_kwargs: dict) -> dict[str, Any] | None:
    """The ``quantization_config`` a checkpoint's config.json carries, if any (or an older compressed-tensors
    checkpoint's ``compression_config``), its ``quant_method`` in lower case and always set."""
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
    else:
        from transformers import AutoConfig  # a hub id: read just its config

        config = AutoConfig.from_pretrained(path, **hub_kwargs).to_dict()
    found = config.get("quantization_config")
    if not found and config.get("compression_config"):
        found = {"quant_method": "compressed-tensors", **config["compression_config"]}
    return {**found, "quant_method": _quant_method(found)} if found else None


def _quant_method(found: dict[str, Any]) -> str:
    """A config's method as written (transformers reads it as written: "GPTQ" is none of its methods), where bitsandbytes'
    older configs give only load_in_8bit or load_in_4bit."""
    if found.get("quant_method"):
        return str(found["quant_method"])
    return "bitsandbytes" if found.get("load_in_8bit") or found.get("load_in_4bit") else "unknown"


def _prequantized_advice(existing: dict[str, Any]) -> str:
    method = existing.get("quant_method")
    if method == "gptq":
        return "the checkpoint is GPTQ-quantized; set model.quantization: gptq to serve it"
    return (
        f"the checkpoint is pre-quantized with {method}, which this server does not load; serve the "
        "full-precision model with quantization: bnb-int8 or bnb-nf4, or a GPTQ checkpoint with quantization: gptq"
    )


def _gptq_kwargs(existing: dict[str, Any] | None, device: torch.device) -> dict[str, Any]:
    if existing and existing["quant_method"] != "gptq" and existing["quant_method"].lower() == "gptq":
        raise QuantizationError(f"its quantization_config's quant_method is {existing['quant_method']!r}, which "
                                "transformers does not read; write it \"gptq\" in config.json")
    if not existing or existing.get("quant_method") != "gptq":
        found = f"a {existing.get('quant_method')} quantization_config" if existing else "no quantization_config"
        raise QuantizationError(
            f"quantization: gptq needs a GPTQ checkpoint, but its config.json has {found} (an older AutoGPTQ "
            "checkpoint keeps it in quantize_config.json alone: copy those settings into config.json as "
            "quantization_config with quant_method: gptq); make one with `python -m app quantize SOURCE OUTPUT_DIR`, "
            "or use quantization: none / bnb-int8 / bnb-nf4"
        )
    if existing.get("lm_head"):
        raise QuantizationError("its lm_head is GPTQ-quantized (quantization_config lm_head: true), which transformers' "
                                "GPTQ loader does not read; quantize the model again with the head left in full precision")
    if existing.get("dynamic"):
        raise QuantizationError("its quantization_config has per-module overrides (dynamic: other bits, group sizes or "
                                "skipped modules for some layers), which transformers' GPTQ loader does not read; "
                                "quantize the model again with one setting for every layer")
    for module, package in (("gptqmodel", "gptqmodel==7.6.0"), ("optimum", "optimum==2.3.0")):
        if importlib.util.find_spec(module) is None:
            raise QuantizationError(f"GPTQ checkpoints load through {module}, which is not installed: pip install {package}")
    if device.type not in ("cpu", "cuda"):
        raise QuantizationError(f"GPTQ kernels run on cpu or cuda, not {device.type}")
    return {}  # transformers reads the checkpoint's quantization_config and picks GPTQModel's kernel


def _bnb_config(method: str, dtype: torch.dtype, device: torch.device):
    check_bitsandbytes(device)
    from transformers import BitsAndBytesConfig

    if method == "bnb-int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def check_bitsandbytes(device: torch.device) -> None:
    """bitsandbytes must import and have a backend for ``device`` (CUDA, or its CPU backend)."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # a missing package or a broken native library
        raise QuantizationError(
            f"bitsandbytes is not usable here ({exc}); pip install bitsandbytes==0.50.2, "
            "or choose quantization: gptq or none"
        ) from exc
    if device.type not in ("cpu", "cuda"):
        raise QuantizationError(f"bitsandbytes has no backend for {device.type}; use quantization: none")


def quantized_linear_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes the quantized Linear layers hold, bytes the same layers take in bf16)."""
    quantized = dense = 0
    for module in model.modules():
        shape = _quantized_shape(module)
        if shape is None:
            continue
        quantized += sum(t.numel() * t.element_size() for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))
        dense += shape[0] * shape[1] * 2
    return quantized, dense


def _quantized_shape(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a GPTQ or bitsandbytes Linear (or a GPTQ layer on our int4 kernel); None for anything else."""
    cls = type(module).__name__
    if cls in ("Linear8bitLt", "Linear4bit", "Int4Linear") or hasattr(module, "qweight"):
        return int(module.in_features), int(module.out_features)
    return None


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (quantized weights, scales and zero points included)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}  # tied weights once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def left_in_full_precision(model: torch.nn.Module) -> dict[str, int]:
    """Parameters of weight matrices a quantized load left at full precision, by the class of the module holding them:
    transformers quantizes ``nn.Linear`` (and Conv1D) layers alone, so fused MoE experts (transformers 5's
    ``MixtralExperts``) or a Linear subclass (``FalconLinear``) stay as they were. Embeddings and the output head
    are left out (quantized by neither method here)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    left: dict[str, int] = {}
    for module in model.modules():
        if module is head or isinstance(module, torch.nn.Embedding) or _quantized_shape(module) is not None:
            continue
        matrices = [p for p in module.parameters(recurse=False) if p.dim() >= 2 and p.is_floating_point()]
        if matrices:
            left[type(module).__name__] = left.get(type(module).__name__, 0) + sum(p.numel() for p in matrices)
    return left


def warn_about_unquantized(source: str, method: str, model: torch.nn.Module) -> None:
    """bitsandbytes quantizes nn.Linear layers alone: a model whose weights are mostly elsewhere (fused MoE experts)
    loads mostly at full precision, which the memory a user planned for does not expect."""
    left = left_in_full_precision(model)
    quantized = quantized_linear_bytes(model)[1] // 2  # their parameters (the bytes they take in bf16, halved)
    total = quantized + sum(left.values())
    if sum(left.values()) > 0.1 * total:
        shown = ", ".join(f"{name} ({count / 1e6:.1f}M)" for name, count in sorted(left.items(), key=lambda kv: -kv[1])[:3])
        logger.warning("model %s: %s quantized %.0f%% of its weight matrices; %s stay at full precision (transformers "
                       "quantizes nn.Linear layers alone)", source, method, 100 * quantized / total, shown)
