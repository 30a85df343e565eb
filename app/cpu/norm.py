"""RMSNorm in one call on AVX2 CPUs (``kernels/rms_norm_avx2.c``; built by ``cpu_kernels``).

transformers' RMSNorm is seven small torch ops; a 30-layer model runs 61 norms a step, and the
kernel saves ~1.9 ms of every decode step on the 2-core dev machine (docs/engine.md). transformers
marks these modules for kernel replacement itself (``use_kernel_forward_from_hub("RMSNorm")``);
we do the same without the Hub: the module stays in place, with its weight and name, and only its
``forward`` is replaced.

Model families write RMSNorm differently (Gemma scales by ``1 + weight``, some norms cast before the
weight), so a module is only switched after our kernel reproduced its own ``forward`` on a test
input; any module that does not match, and any input that is not fp32 on CPU, keeps torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
from torch import nn

from app.engine.cpu_kernels import load_library, profiler_label

logger = logging.getLogger(__name__)

_EPS_ATTRIBUTES = ("variance_epsilon", "eps")  # Llama-style and Qwen/Mistral-style names
_CHECK_ROWS = 3


class RMSNormKernel:
    label = "llm_serve::rms_norm"  # its name in torch's profiler

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float]
        lib.rms_norm.restype = None
        self._lib = lib

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # 61 calls a decode step: pointers only, no reshaped views (each costs about as much as the C call)
        if not x.is_contiguous():
            x = x.contiguous()
        hidden = weight.shape[0]
        out = torch.empty_like(x)
        with profiler_label(self.label):
            self._lib.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden, eps)
        return out


@functools.cache
def load_rms_norm() -> RMSNormKernel | None:
    lib = load_library("rms_norm_avx2")
    return RMSNormKernel(lib) if lib is not None else None


class _FusedForward:
    """A norm module's new ``forward``: our kernel for fp32 CPU inputs, the module's own otherwise."""

    def __init__(self, module: nn.Module, kernel: RMSNormKernel, eps: float) -> None:
        self.module, self.kernel, self.eps = module, kernel, eps

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == torch.float32 and hidden_states.device.type == "cpu":
            return self.kernel(hidden_states, self.module.weight, self.eps)
        return type(self.module).forward(self.module, hidden_states)


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every RMSNorm of ``model`` that our kernel reproduces a one-call ``forward``; returns how many."""
    kernel = load_rms_norm()
    if kernel is None:
        return 0
    fused, mismatched = 0, set()
    for module in model.modules():
        eps = _candidate_eps(module)
        if eps is None:
            continue
        if not _reproduces(kernel, module, eps):
            mismatched.add(type(module).__name__)
            continue
        module.forward = _FusedForward(module, kernel, eps)
        fused += 1
    if mismatched:
        logger.info("RMSNorm kernel skipped for %s: its formula differs from Llama's; torch runs them", ", ".join(sorted(mismatched)))
    if fused:
        logger.info("%d RMSNorm modules run on the fused CPU kernel", fused)
    return fused


def _candidate_eps(module: nn.Module) -> float | None:
    """The epsilon of a module that looks like an RMSNorm over fp32 CPU weights, else None."""
    if not type(module).__name__.endswith("RMSNorm") or "forward" in module.__dict__:
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not weight.is_contiguous():
        return None
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    for name in _EPS_ATTRIBUTES:
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return eps
    return None


@torch.no_grad()
def _reproduces(kernel: RMSNormKernel, module: nn.Module, eps: float) -> bool:
    """Does the kernel give the module's own output on a test input (to float rounding)?"""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_CHECK_ROWS, module.weight.shape[0], generator=generator) * 3
    expected = type(module).forward(module, x)
    return expected.shape == x.shape and torch.allclose(kernel(x, module.weight, eps), expected, rtol=1e-5, atol=1e-6)


def fused_norm_forwards(model: nn.Module) -> dict[nn.Module, _FusedForward]:
    """The modules of ``model`` running on the kernel, with their fused forwards (for benchmarks)."""
    return {m: m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), _FusedForward)}
