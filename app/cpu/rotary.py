"""Rotary position embedding in one call on AVX2 CPUs (``kernels/rotary_avx2.c``; built by ``cpu_kernels``).

transformers applies RoPE as ~14 small torch ops a layer, ~1.7 ms of a 30-layer one-sequence decode
step on the 2-core dev machine. It marks the function for kernel replacement itself
(``use_kernel_forward_from_hub("rotary_pos_emb")``), but the attention modules call it as a global of
their modeling module, so a kernel can only take its place there: like liger-kernel, we replace
``apply_rotary_pos_emb`` in the model's modeling module (``transformers.models.llama.modeling_llama``
for SmolLM2). That is process-wide, so the replacement is exact: it is installed only after it gave
the module's own function's bits on test inputs (other variants, e.g. interleaved rotation, keep
theirs), and every call it cannot serve (not fp32 on CPU, autograd on, partial rotary, other layouts)
goes to the original function.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from typing import Callable

import torch
from torch import nn

from app.engine.cpu_kernels import load_library, profiler_label

logger = logging.getLogger(__name__)

_FUNCTION = "apply_rotary_pos_emb"


class RotaryKernel:
    label = "llm_serve::rotary"  # its name in torch's profiler

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i64, i64, i64]
        lib.rotary.restype = None
        self._lib = lib

    def __call__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, H, T, D], k [B, Hkv, T, D] (last dim contiguous), cos/sin [B or 1, T, D] with equal strides."""
        # 30 calls a decode step: a stride tuple read once, outputs made in their final layout
        # (each extra view or stride() call costs ~0.3-1.5 us; torch's ops took ~57 us a call)
        batch, q_heads, tokens, dim = q.shape
        k_heads = k.shape[1]
        qs, ks, cs = q.stride(), k.stride(), cos.stride()
        # [B, T, H, D] memory seen as [B, H, T, D]: the layout torch's ops give for the usual transposed q and k
        q_out = torch.empty_strided((batch, q_heads, tokens, dim), (tokens * q_heads * dim, dim, q_heads * dim, 1))
        k_out = torch.empty_strided((batch, k_heads, tokens, dim), (tokens * k_heads * dim, dim, k_heads * dim, 1))
        with profiler_label(self.label):
            self._lib.rotary(
                q.data_ptr(), qs[0], qs[1], qs[2], q_heads, k.data_ptr(), ks[0], ks[1], ks[2], k_heads,
                cos.data_ptr(), sin.data_ptr(), cs[0] if cos.shape[0] == batch else 0, cs[1],
                q_out.data_ptr(), k_out.data_ptr(), batch, tokens, dim,
            )
        return q_out, k_out


@functools.cache
def load_rotary() -> RotaryKernel | None:
    lib = load_library("rotary_avx2")
    return RotaryKernel(lib) if lib is not None else None


class FusedRotary:
    """A modeling module's new ``apply_rotary_pos_emb``: our kernel where it applies, the original elsewhere."""

    def __init__(self, original: Callable, kernel: RotaryKernel) -> None:
        self.original, self.kernel = original, kernel
        functools.update_wrapper(self, original)

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        if not args and kwargs.keys() <= {"unsqueeze_dim"} and kwargs.get("unsqueeze_dim", 1) == 1 and _servable(q, k, cos, sin):
            return self.kernel(q, k, cos, sin)
        return self.original(q, k, cos, sin, *args, **kwargs)


def _servable(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    f32 = torch.float32
    if q.dtype is not f32 or k.dtype is not f32 or cos.dtype is not f32 or sin.dtype is not f32:
        return False  # other dtypes have their own kernels
    if not (q.is_cpu and k.is_cpu and cos.is_cpu and sin.is_cpu) or torch.is_grad_enabled():
        return False  # autograd needs torch's ops
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return False
    batch, _, tokens, dim = q.shape
    k_batch, _, k_tokens, k_dim = k.shape
    cos_batch, cos_tokens, cos_dim = cos.shape
    if k_batch != batch or k_tokens != tokens or k_dim != dim or dim % 2 or cos_tokens != tokens or cos_dim != dim:
        return False  # partial rotary (cos narrower than the head) and broadcasting layouts stay torch's
    if cos_batch not in (1, batch) or sin.shape != cos.shape or sin.stride() != cos.stride():
        return False
    return q.stride(3) == 1 and k.stride(3) == 1 and cos.stride(2) == 1


def fuse_rotary(model: nn.Module) -> bool:
    """Put the kernel in place of ``apply_rotary_pos_emb`` in the modeling module of ``model``'s attention, if exact."""
    kernel = load_rotary()
    namespace = _modeling_module(model)
    if kernel is None or namespace is None:
        return False
    current = getattr(namespace, _FUNCTION)
    if isinstance(current, FusedRotary):
        return True  # an earlier engine in this process installed it
    if not _reproduces(kernel, current):
        logger.info("rotary kernel skipped for %s: its %s differs from Llama's; torch runs it", namespace.__name__, _FUNCTION)
        return False
    setattr(namespace, _FUNCTION, FusedRotary(current, kernel))
    logger.info("%s.%s runs on the fused CPU kernel for fp32 CPU inputs", namespace.__name__, _FUNCTION)
    return True


def unfuse_rotary(model: nn.Module) -> None:
    """Give ``model``'s modeling module its own ``apply_rotary_pos_emb`` back (``cpu_rotary_kernel: torch``)."""
    installed = installed_rotary(model)
    if installed is not None:
        namespace, fused = installed
        setattr(namespace, _FUNCTION, fused.original)


def installed_rotary(model: nn.Module):
    """(modeling module, our FusedRotary) where ``fuse_rotary`` installed it for ``model``, else None (benchmarks)."""
    namespace = _modeling_module(model)
    current = getattr(namespace, _FUNCTION, None)
    return (namespace, current) if isinstance(current, FusedRotary) else None


def _modeling_module(model: nn.Module):
    """The module defining ``model``'s attention layers, if they call a module-level ``apply_rotary_pos_emb``."""
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            namespace = sys.modules.get(type(module).__module__)
            if callable(getattr(namespace, _FUNCTION, None)):
                return namespace
    return None


@torch.no_grad()
def _reproduces(kernel: RotaryKernel, function: Callable) -> bool:
    """Does the kernel give ``function``'s exact bits, for one token and several, one sequence and two?"""
    generator = torch.Generator().manual_seed(0)
    for batch, tokens in ((1, 1), (1, 5), (2, 3)):
        q = torch.randn(batch, tokens, 4, 64, generator=generator).transpose(1, 2) * 4
        k = torch.randn(batch, tokens, 2, 64, generator=generator).transpose(1, 2) * 4
        angles = torch.rand(batch, tokens, 64, generator=generator) * 50
        cos, sin = angles.cos(), angles.sin()
        try:
            expected = function(q, k, cos, sin)
        except Exception:  # noqa: BLE001 - another signature: not the function our kernel implements
            return False
        got = kernel(q, k, cos, sin)
        if not all(isinstance(e, torch.Tensor) and e.shape == g.shape and torch.equal(e, g) for e, g in zip(expected, got)):
            return False
    return True
