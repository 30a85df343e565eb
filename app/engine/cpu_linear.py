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

Sibling projections that read the same input (``q_proj``/``k_proj``/``v_proj`` of an attention
layer, ``gate_proj``/``up_proj`` of an MLP) are packed as one weight and run as one GEMM, as vLLM's
QKV and merged column layers do: fewer, wider calls (per step ~90 fewer kernel launches on a 30-layer
model). The transformers modules still call each projection by name; the first call computes all of
them and the siblings return their slice of it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

_BATCH_HINT = 32  # oneDNN picks the packed layout for this many rows; it serves any row count
# Projections that transformers' attention and MLP modules apply to the same input, in call order.
SIBLING_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


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


class _SharedProjection:
    """One packed GEMM for sibling projections of the same input; each member reads its slice once."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        weight = torch.cat([linear.weight.detach() for linear in linears])
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
        biases = [linear.bias for linear in linears]
        self.bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        self.sizes = [linear.out_features for linear in linears]
        self._input: torch.Tensor | None = None  # held while slices are unread, so `is` cannot alias
        self._unread: dict[int, torch.Tensor] = {}

    def output(self, member: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input or member not in self._unread:  # first sibling called on this input
            fused = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
            self._input, self._unread = x, dict(enumerate(fused.split(self.sizes, dim=-1)))
        out = self._unread.pop(member)
        if not self._unread:
            self._input = None
        return out


class PackedSiblingLinear(nn.Module):
    """One of several sibling projections packed together (see :class:`_SharedProjection`)."""

    def __init__(self, shared: _SharedProjection, member: int, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.shared, self.member = shared, member
        if member == 0:  # the packed weight is counted once, on the first sibling
            self.register_buffer("packed_weight", shared.packed_weight, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.output(self.member, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn_packed=True, fused_with_siblings=True"


def packing_supported() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_cpu_linears(model: nn.Module) -> int:
    """Replace every plain fp32 CPU ``nn.Linear`` of ``model`` by a :class:`PackedLinear`; returns how many."""
    if not packing_supported():
        logger.info("oneDNN is not available in this torch build: Linear layers stay on the default kernels")
        return 0
    replaced = sum(_fuse_siblings(parent) for parent in list(model.modules()))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _packable(child):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    if replaced:
        _release_checkpoint_mapping(model)
        logger.info("%d fp32 Linear layers run through oneDNN with prepacked weights", replaced)
    return replaced


def _fuse_siblings(parent: nn.Module) -> int:
    """Pack each group of ``parent``'s sibling projections as one weight; returns how many layers."""
    replaced = 0
    for names in SIBLING_PROJECTIONS:
        linears = [getattr(parent, name, None) for name in names]
        if not _fusable(linears):
            continue
        shared = _SharedProjection(linears)
        for member, (name, linear) in enumerate(zip(names, linears)):
            setattr(parent, name, PackedSiblingLinear(shared, member, linear))
        replaced += len(names)
    return replaced


def _fusable(linears: list) -> bool:
    return (
        all(_packable(linear) for linear in linears)
        and len({linear.in_features for linear in linears}) == 1
        and len({linear.bias is None for linear in linears}) == 1
    )


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
