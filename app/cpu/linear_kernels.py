"""The Linear kernels a packed layer can run: ours (``avx2``, ``avx512-bf16``), oneDNN's (``onednn``, ``onednn-bf16``)
and torch's own, each packing a weight once into its layout and applying it; which one the engine takes
(``select_kernel`` for a named one, ``bake_off_candidates`` for what ``auto`` times: ``kernel_choice.py``), and
whether this CPU and torch build run each. How layers use them: ``linear.py``.
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from app.config import CPU_LINEAR_KERNELS
from app.cpu.kernel_choice import Bucket
from app.cpu.ops import OPS, available, unavailable_reason
from app.engine import host_cpus

logger = logging.getLogger(__name__)

_BATCH_HINT = 32  # oneDNN picks the packed layout for this many rows; it serves any row count


class LinearKernel(Protocol):
    name: str

    def pack(self, weight: torch.Tensor) -> torch.Tensor: ...

    def apply(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor: ...


class OneDNNKernel:
    name = "onednn"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)

    def apply(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class OneDNNBF16Kernel:
    """bf16 products through oneDNN: weights stored as bf16, activations rounded to bf16 at each call, the bf16
    result widened back to fp32 (norms, residuals and attention stay fp32). On a CPU with avx512_bf16 oneDNN runs
    them as ``vdpbf16ps`` (two products per fp32 lane); elsewhere it emulates them, slowly. Opt-in: it changes the
    model's numbers (like serving in bf16), not only their last bits."""

    name = "onednn-bf16"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), _BATCH_HINT)

    def apply(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "").float()
        return y if bias is None else y + bias


class AVX512BF16Kernel:
    """bf16 products on our kernel (``kernels/linear_avx512bf16.c``, ``vdpbf16ps``): weights stored as bf16 in
    groups of 64 columns, activations rounded to bf16 at each call, every output summed in fp32 in one fixed
    order (the same bits alone or in any batch, unlike oneDNN's). For CPUs with avx512_bf16: what ``auto`` takes
    where the loader chose bf16 products, else asked for by name (it changes the model's numbers as bf16 does)."""

    name = "avx512-bf16"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape
        groups, k2 = -(-n // 64), -(-k // 2)
        padded = weight.new_zeros(groups * 64, k2 * 2, dtype=torch.bfloat16)
        padded[:n, :k] = weight.detach()  # rounds to nearest even, as activations are
        # [group][k pair][panel][column][pair member]: each k pair of a group is four 64-byte vectors
        return padded.view(groups, 4, 16, k2, 2).permute(0, 3, 1, 2, 4).contiguous().view(-1)

    def apply(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        return OPS.linear_bf16dot(x, packed, bias, out_features)

    def apply_add(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                  residual: torch.Tensor) -> torch.Tensor:
        if residual.dtype != torch.float32 or not residual.is_contiguous():
            return residual + self.apply(x, packed, bias, out_features)
        return OPS.linear_bf16dot(x, packed, bias, out_features, residual)


class AVX2Kernel:
    name = "avx2"

    def __init__(self, weight_dtype: torch.dtype = torch.float32) -> None:
        self.weight_dtype = weight_dtype  # bfloat16: half the bytes, widened to fp32 in registers
        if weight_dtype == torch.bfloat16:
            self.name = "avx2-bf16-weights"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        dtype = self.weight_dtype
        if dtype == torch.float32 and bf16_exact(weight):
            # e.g. a bf16 checkpoint loaded as fp32: bf16 holds every value exactly, so half the
            # bytes to stream and the same bits out (the kernel widens them back before any FMA)
            dtype = torch.bfloat16
        return OPS.pack_linear_weight(weight.detach().float(), dtype)

    def apply(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        return OPS.linear(x, packed, bias, out_features)


class TorchKernel:
    """torch's own ``F.linear`` on the dense weight (MKL's sgemm on x86): a bake-off candidate."""

    name = "torch"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.detach().clone()  # its own memory: the checkpoint's map can be released

    def apply(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        return F.linear(x, packed, bias)


# Kernels that sum every output in one fixed order whatever the row count: a row's bits never depend on its batch
FIXED_ORDER = frozenset({"avx2", "avx2-bf16-weights", "avx512-bf16"})  # (not torch-bf16-weights: MKL's sums)


class RowBucketKernel:
    """Each row count on the kernel the bake-off chose for its bucket (``kernel_choice.py``); the weight is packed once
    per distinct kernel, so a shape that mixes two holds two copies."""

    def __init__(self, by_bucket: list[tuple[Bucket, LinearKernel]]) -> None:
        self.kernels: list[LinearKernel] = []
        self.routes: list[tuple[int | None, int]] = []  # (highest row count, index into kernels), ascending
        for bucket, kernel in by_bucket:
            if kernel not in self.kernels:
                self.kernels.append(kernel)
            index = self.kernels.index(kernel)
            if self.routes and self.routes[-1][1] == index:
                self.routes[-1] = (bucket.high, index)  # adjacent buckets on one kernel: one route
            else:
                self.routes.append((bucket.high, index))
        self.name = " / ".join(f"{self.kernels[index].name} {_rows_named(low, high)}"
                               for (high, index), low in zip(self.routes, _route_lows(self.routes)))

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(kernel.pack(weight) for kernel in self.kernels)

    def apply(self, x: torch.Tensor, packed: tuple, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        index = self._route(x)
        return self.kernels[index].apply(x, packed[index], bias, out_features)

    def apply_add(self, x: torch.Tensor, packed: tuple, bias: torch.Tensor | None, out_features: int,
                  residual: torch.Tensor) -> torch.Tensor:
        index = self._route(x)
        return apply_add(self.kernels[index], x, packed[index], bias, out_features, residual)

    def _route(self, x: torch.Tensor) -> int:
        """The index of the kernel for ``x``'s row count."""
        rows = x.numel() // x.shape[-1]
        for high, index in self.routes:
            if high is None or rows <= high:
                return index
        raise AssertionError("the last route takes every row count")


def apply_add(kernel: LinearKernel, x: torch.Tensor, packed, bias: torch.Tensor | None, out_features: int,
              residual: torch.Tensor) -> torch.Tensor:
    """``residual + kernel.apply(...)``, the sum taken as the kernel stores its outputs where it can (a decoder layer's
    residual connections: one op and one pass over the activations less), with the same bits either way."""
    adding = getattr(kernel, "apply_add", None)
    if adding is not None:
        return adding(x, packed, bias, out_features, residual)
    return residual + kernel.apply(x, packed, bias, out_features)


def _route_lows(routes: list[tuple[int | None, int]]) -> list[int]:
    return [1] + [high + 1 for high, _ in routes[:-1]]


def _rows_named(low: int, high: int | None) -> str:
    return f"{low}+ rows" if high is None else (f"{low} row" if low == high == 1 else f"{low}-{high} rows")


def select_kernel(choice: str, weight_dtype: torch.dtype = torch.float32, bf16_products: bool = False) -> LinearKernel | None:
    """The kernel ``engine.cpu_linear_kernel`` names (None: torch's own); asking for one this machine lacks is an error.

    ``weight_dtype`` bfloat16 asks for bf16 weights on fp32 activations, which only our kernel does;
    ``bf16_products`` (the loader's choice for bf16 where the CPU has avx512_bf16) makes ``auto`` our bf16 kernel.
    """
    if choice not in CPU_LINEAR_KERNELS:
        raise ValueError(f"engine.cpu_linear_kernel {choice!r} is not one of {', '.join(CPU_LINEAR_KERNELS)}")
    if choice == "torch":
        return None
    if choice == "avx512-bf16" or (choice == "auto" and bf16_products):
        if not bf16_products_available():
            why = unavailable_reason() or "this CPU has no avx512_bf16"
            raise ValueError(f"engine.cpu_linear_kernel is avx512-bf16, but {why}; use auto or onednn-bf16")
        return AVX512BF16Kernel()
    if choice == "onednn-bf16":
        if not onednn_bf16_supported():
            raise ValueError("engine.cpu_linear_kernel is onednn-bf16, but oneDNN has no bf16 path on this CPU "
                             "(it needs avx512bw/vl/dq or avx_ne_convert) or in this torch build; use auto")
        return OneDNNBF16Kernel()
    if choice in ("auto", "avx2"):
        if available():
            return AVX2Kernel(weight_dtype)
        if choice == "avx2":
            raise ValueError(f"engine.cpu_linear_kernel is avx2, but {unavailable_reason()}; use auto")
    if weight_dtype != torch.float32:
        logger.warning("bf16 weights need the avx2 kernel (engine.cpu_linear_kernel %s): they stay fp32", choice)
    if onednn_supported():
        return OneDNNKernel()
    if choice == "onednn":
        raise ValueError("engine.cpu_linear_kernel is onednn, but this torch build has no oneDNN; use auto")
    logger.info("oneDNN is not available in this torch build: Linear layers stay on the default kernels")
    return None


def bf16_exact(weight: torch.Tensor) -> bool:
    """Is every value of this fp32 weight a bf16 value (so storing it as bf16 loses nothing)?"""
    return torch.equal(weight, weight.detach().to(torch.bfloat16).to(torch.float32))


def onednn_supported() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def onednn_bf16_supported() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU (it needs avx512bw/vl/dq or avx_ne_convert: an AVX2-only
    CPU has neither). Asked of oneDNN itself, once, on a tiny weight."""
    if not onednn_supported():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), _BATCH_HINT)
    except RuntimeError:
        return False
    return True


def bake_off_candidates(bf16_products: bool, weight_dtype: torch.dtype = torch.float32) -> dict[str, LinearKernel]:
    """The kernels this CPU runs with the same numbers as ``auto``'s incumbent: bf16 products; fp32 products on
    weights rounded to bf16 (``weight_dtype`` bfloat16: ours streams them as bf16, the others hold them widened, at
    twice the bytes); or fp32 products."""
    if bf16_products:
        kernels = [AVX512BF16Kernel() if bf16_products_available() else None,
                   OneDNNBF16Kernel() if onednn_bf16_supported() else None]
    elif weight_dtype == torch.bfloat16:
        kernels = [AVX2Kernel(torch.bfloat16) if available() else None,
                   BF16RoundedWeights(OneDNNKernel()) if onednn_supported() else None, BF16RoundedWeights(TorchKernel())]
    else:
        kernels = [AVX2Kernel() if available() else None, OneDNNKernel() if onednn_supported() else None, TorchKernel()]
    return {kernel.name: kernel for kernel in kernels if kernel is not None}


class BF16RoundedWeights:
    """An fp32 kernel on the weights rounded to bf16 (as ``avx2-bf16-weights`` computes), held widened to fp32."""

    def __init__(self, inner: LinearKernel) -> None:
        self.inner, self.name = inner, f"{inner.name}-bf16-weights"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return self.inner.pack(weight.detach().to(torch.bfloat16).float())

    def apply(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        return self.inner.apply(x, packed, bias, out_features)


def bf16_products_available() -> bool:
    """Whether our bf16 kernel runs here: the kernels built (with their avx512_bf16 code) and the CPU has it."""
    return available() and cpu_has_avx512_bf16() and bool(OPS.linear_bf16dot_built())


@functools.cache
def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU executes ``vdpbf16ps`` (the kernel's one instruction beyond AVX-512F/BW/VL)."""
    return "avx512_bf16" in (host_cpus.cpu_flags() or ())  # not Linux: no way to ask here, so no
