"""fp32 Linear layers on CPU through oneDNN with prepacked weights (what IPEX and inductor's freezing do).

torch runs an fp32 ``nn.Linear`` on CPU through MKL's sgemm, whose small-M path is slow on the AVX2
AMD EPYC dev machine: a decode step of 2 sequences took as long as one of 16. With the weights
reordered once into oneDNN's blocked layout, steps of 1-32 sequences spend 1.2-2.6x less time in
matrix multiplies (``python -m app.bench profile``; the table is in docs/engine.md).

Only modules whose type is exactly ``nn.Linear`` with fp32 CPU weights are replaced, so quantized
layers (bitsandbytes, GPTQ) and every other device or dtype run as loaded. The packed weight replaces
the dense one (same bytes); a tied output head gets its own packed copy while the embedding keeps
the original, so packing costs about the head's size in memory. Results differ from MKL's only in
float summation order (the last few bits).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

_BATCH_HINT = 32  # oneDNN picks the packed layout for this many rows; it serves any row count


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn_packed=True"


def packing_supported() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_cpu_linears(model: nn.Module) -> int:
    """Replace every plain fp32 CPU ``nn.Linear`` of ``model`` by a :class:`PackedLinear`; returns how many."""
    if not packing_supported():
        logger.info("oneDNN is not available in this torch build: Linear layers stay on the default kernels")
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _packable(child):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    if replaced:
        _release_checkpoint_mapping(model)
        logger.info("%d fp32 Linear layers run through oneDNN with prepacked weights", replaced)
    return replaced


def _release_checkpoint_mapping(model: nn.Module) -> None:
    """Copy the remaining CPU tensors out of the checkpoint's memory map, so the map can be closed.

    transformers maps an fp32 safetensors checkpoint into memory as is. The dense Linear weights we
    just replaced live in that map, and any tensor still viewing it (the embedding, the norms) keeps
    every page of it resident. Copying those few tensors (mostly the embedding) lets it go: measured
    on SmolLM2-135M fp32, RSS 1862 -> 1415-1448 MB across runs (unpacked: 1321).
    """
    for param in model.parameters():
        if param.device.type == "cpu":
            param.data = param.data.clone()  # the same Parameter object: tied modules stay tied
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type == "cpu" and not buffer.is_mkldnn:
                module._buffers[name] = buffer.clone()


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
    )
