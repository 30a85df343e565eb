"""The gated MLP's ``silu(gate) * up`` in one call on CPU (``kernels/silu_mul.c``, ``llm_serve::silu_mul``).

torch runs it as two ops on a strided slice of the shared gate/up GEMM's output; the kernel reads each
row once and writes the product, 1.6x torch's pair at 32 rows and 2x at 1,792 on a 2-core AVX-512 EPYC
(docs/engine.md). It gives torch's bits: it calls the same SLEEF exp torch's silu does for this CPU's vector
width (torch's CPU capability) at the same places of a row, and the C library's ``expf`` where torch's loop
runs scalar code. The gated MLP that uses it is still switched only after it reproduced the module's own
output (``linear.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from app.cpu.ops import OPS, available

# the vector width of torch's own CPU kernels: the places of a row where its silu uses SLEEF's exp
_LANES = {"AVX512": 16, "AVX2": 8, "DEFAULT": 1}


def silu_mul_lanes(act_fn: nn.Module) -> int | None:
    """The ``lanes`` argument of :func:`silu_mul` reproducing ``act_fn(gate) * up``, or None where it cannot:
    ``act_fn`` is not SiLU, the kernels are not built, or torch runs its CPU ops at a width we do not know."""
    silu = isinstance(act_fn, nn.SiLU) or (type(act_fn).__name__ == "SiLUActivation" and not act_fn.__dict__.get("forward"))
    if not silu or not available():
        return None
    return _LANES.get(torch.backends.cpu.get_cpu_capability())


def silu_mul(gate_up: torch.Tensor, lanes: int) -> torch.Tensor:
    """``silu(gate) * up`` of rows ``[..., gate | up]`` (fp32, CPU)."""
    return OPS.silu_mul(gate_up, lanes)
