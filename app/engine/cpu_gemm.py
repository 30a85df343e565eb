"""Our fp32 GEMM for AVX2 CPUs (``kernels/linear_avx2.c``; built and loaded by ``cpu_kernels``).

Why a kernel of our own: a decode step of a few sequences is a chain of 1-4 row matrix products,
bound by how fast the weights stream from memory. On the AVX2 AMD EPYC dev machine oneDNN and MKL
stream them at 7-17 GB/s where the machine reads at ~21-29 GB/s; this 6x16 micro-kernel (with
one or two rows against several panels at once) streams them at memory speed there: 1.4-1.6x
oneDNN's prepacked GEMM at 1-32 rows, 1.2x at 64, 0.9x at 256 (docs/engine.md). Each output is summed in one fixed order whatever the
batch, so a request's logits do not depend on its batch-mates (tested).

Weights can be packed as bf16 (widened to fp32 in registers; activations and sums stay fp32): a
1-4 row product then streams half the bytes, 1.5-1.6x faster on the dev machine, and 32 rows run
~1.2x faster. This is how ``dtype: bfloat16`` runs on CPUs without native bf16 (``app/models/loader.py``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from app.engine.cpu_kernels import load_library


class AVX2Gemm:
    """``pack`` a weight once; ``linear`` then computes ``x W^T + b`` from the packed panels."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.packed_weight_numel.argtypes, lib.packed_weight_numel.restype = [i64, i64], i64
        for fn in (lib.pack_weight, lib.pack_weight_bf16):
            fn.argtypes, fn.restype = [ptr, ptr, i64, i64], None
        for fn in (lib.linear, lib.linear_bf16w):
            fn.argtypes, fn.restype = [ptr, ptr, ptr, ptr, i64, i64, i64], None
        self._lib = lib

    def pack(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] fp32 -> the kernel's panels, stored as ``dtype`` (float32, or bfloat16: half the bytes)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the AVX2 GEMM stores weights as float32 or bfloat16, not {dtype}")
        weight = weight.detach().float().contiguous()
        n, k = weight.shape
        packed = torch.empty(self._lib.packed_weight_numel(n, k), dtype=dtype)
        pack = self._lib.pack_weight_bf16 if dtype == torch.bfloat16 else self._lib.pack_weight
        pack(weight.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        # Called ~120 times a decode step: only pointers go to C, no reshaped views are built
        # (this wrapper took 14 us a call with them, 3 of which are the C call itself).
        if not x.is_contiguous():
            x = x.contiguous()
        in_features = x.shape[-1]
        out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
        rows = x.numel() // in_features if in_features else 0
        if rows:
            if bias is not None and not bias.is_contiguous():
                bias = bias.contiguous()
            run = self._lib.linear_bf16w if packed.dtype == torch.bfloat16 else self._lib.linear
            run(x.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(), rows, in_features, out_features)
        return out


@functools.cache
def load_avx2_gemm() -> AVX2Gemm | None:
    """The compiled GEMM, or None where this machine cannot build or run it (``cpu_kernels`` logs why)."""
    lib = load_library("linear_avx2")
    return AVX2Gemm(lib) if lib is not None else None
