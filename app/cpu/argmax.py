"""Row-wise argmax of fp32 CPU logits in one call on AVX2 CPUs (``kernels/argmax_avx2.c``; built by ``cpu_kernels``).

torch's CPU argmax is a scalar reduction: ~2 ms of a 32-sequence decode step on the 2-core dev
machine for SmolLM2's 49152 logits a row, where the kernel takes ~0.1 ms. It gives torch's answer
exactly (first index of the largest value; the first NaN's index in a row holding one), so the
sampler uses it wherever it applies, with no setting: anything else goes to ``torch.argmax``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from app.engine.cpu_kernels import load_library, profiler_label

_MAX_ROW = 2**31 - 1  # the kernel keeps indices in 32-bit lanes


class ArgmaxKernel:
    label = "llm_serve::argmax"  # its name in torch's profiler

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.argmax_rows.argtypes, lib.argmax_rows.restype = [ptr, i64, i64, ptr], None
        self._lib = lib

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, n] fp32, contiguous, on CPU -> [rows] int64."""
        rows, n = x.shape
        out = torch.empty(rows, dtype=torch.long)
        with profiler_label(self.label):
            self._lib.argmax_rows(x.data_ptr(), rows, n, out.data_ptr())
        return out


@functools.cache
def load_argmax() -> ArgmaxKernel | None:
    lib = load_library("argmax_avx2")
    return ArgmaxKernel(lib) if lib is not None else None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D tensor, through the kernel where it applies."""
    kernel = load_argmax()
    if (kernel is not None and x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and 0 < x.shape[1] <= _MAX_ROW
            and x.is_contiguous() and not x.requires_grad):
        return kernel(x)
    return x.argmax(dim=-1)
