"""RMSNorm in one call on CPU (``kernels/rms_norm_avx2.c``, ``llm_serve::rms_norm``).

transformers' RMSNorm is seven small torch ops; a 30-layer model runs 61 norms a step, and the
kernel saves ~1.9 ms of every one-sequence decode step on a 2-core AVX2 EPYC (docs/engine.md). transformers
marks these modules for kernel replacement itself (``use_kernel_forward_from_hub("RMSNorm")``);
we do the same without the Hub: the module stays in place, with its weight and name, and only its
``forward`` is replaced.

Model families write RMSNorm differently (Gemma scales by ``1 + weight``, some norms cast before the
weight), so a module is only switched after our kernel reproduced its own ``forward`` on a test
input; any module that does not match, and any input that is not fp32 on CPU, keeps torch's path.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from app.cpu.ops import OPS, available

logger = logging.getLogger(__name__)

_EPS_ATTRIBUTES = ("variance_epsilon", "eps")  # Llama-style and Qwen/Mistral-style names
_CHECK_ROWS = 3


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return OPS.rms_norm(x, weight, eps)


class FusedRMSNormForward:
    """A norm module's new ``forward``: our kernel for fp32 CPU inputs, the module's own otherwise."""

    def __init__(self, module: nn.Module, eps: float) -> None:
        self.module, self.eps = module, eps

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == torch.float32 and hidden_states.device.type == "cpu":
            return OPS.rms_norm(hidden_states, self.module.weight, self.eps)
        return type(self.module).forward(self.module, hidden_states)


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every RMSNorm of ``model`` that our kernel reproduces a one-call ``forward``; returns how many."""
    if not available():
        return 0
    fused, mismatched = 0, set()
    for module in model.modules():
        eps = _candidate_eps(module)
        if eps is None:
            continue
        if not _reproduces(module, eps):
            mismatched.add(type(module).__name__)
            continue
        module.forward = FusedRMSNormForward(module, eps)
        fused += 1
    if mismatched:
        logger.debug("RMSNorm kernel skipped for %s: its formula differs from Llama's; torch runs them", ", ".join(sorted(mismatched)))
    return fused


def unfuse_rms_norms(model: nn.Module) -> None:
    """Give every norm of ``model`` its own ``forward`` back."""
    for module in list(fused_norm_forwards(model)):
        del module.forward


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
def _reproduces(module: nn.Module, eps: float) -> bool:
    """Does the kernel give the module's own output on a test input (to float rounding)?"""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_CHECK_ROWS, module.weight.shape[0], generator=generator) * 3
    expected = type(module).forward(module, x)
    return expected.shape == x.shape and torch.allclose(rms_norm(x, module.weight, eps), expected, rtol=1e-5, atol=1e-6)


def fused_norm_forwards(model: nn.Module) -> dict[nn.Module, FusedRMSNormForward]:
    """The modules of ``model`` running on the kernel, with their fused forwards (for benchmarks)."""
    return {m: m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), FusedRMSNormForward)}
