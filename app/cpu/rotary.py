"""Rotary position embedding in one call on CPU (``kernels/rotary_avx2.c``, ``llm_serve::rotary``).

transformers applies RoPE as ~14 small torch ops a layer, ~1.7 ms of a 30-layer one-sequence decode
step on a 2-core AVX2 EPYC. The attention modules call it as ``apply_rotary_pos_emb``, a global of
their modeling module; rather than replace that global (which would change every model of the
process), the one-frame decoder layer forward (``decoder.py``) calls :class:`KernelRotary` in its
place. :func:`rotary_for` hands one out only after it gave that function's exact bits on test inputs
(other variants, e.g. interleaved rotation, keep theirs), and every call it cannot serve (not fp32 on
CPU, autograd on, partial rotary, other layouts) goes to the original function.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

import torch
from torch import nn

from app.cpu.ops import OPS, available

FUNCTION_NAME = "apply_rotary_pos_emb"


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, T, D], k [B, Hkv, T, D] (last dim contiguous), cos/sin [B or 1, T, D] with equal strides."""
    return OPS.rotary(q, k, cos, sin)


class KernelRotary:
    """A stand-in for a modeling module's ``apply_rotary_pos_emb``: the kernel where it applies, the original elsewhere."""

    def __init__(self, original: Callable) -> None:
        self.original = original
        functools.update_wrapper(self, original)

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        if not args and kwargs.keys() <= {"unsqueeze_dim"} and kwargs.get("unsqueeze_dim", 1) == 1 and servable(q, k, cos, sin):
            return OPS.rotary(q, k, cos, sin)
        return self.original(q, k, cos, sin, *args, **kwargs)


def servable(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Inputs the kernel takes (the op would refuse the others with an error)."""
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


def modeling_rotary(attention: nn.Module) -> Callable | None:
    """The ``apply_rotary_pos_emb`` that ``attention``'s modeling module calls, if it has one."""
    function = getattr(sys.modules.get(type(attention).__module__), FUNCTION_NAME, None)
    return function if callable(function) else None


@functools.cache
def rotary_for(function: Callable) -> KernelRotary | None:
    """A :class:`KernelRotary` standing in for ``function``, or None where the kernel does not give its exact bits."""
    if not available() or not _reproduces(function):
        return None
    return KernelRotary(function)


@torch.no_grad()
def _reproduces(function: Callable) -> bool:
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
        got = rotary(q, k, cos, sin)
        if not all(isinstance(e, torch.Tensor) and e.shape == g.shape and torch.equal(e, g) for e, g in zip(expected, got)):
            return False
    return True
