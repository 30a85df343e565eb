"""Our fp32 GEMM for AVX2 CPUs (``kernels/linear_avx2.c``), compiled with the system C compiler at first use.

Why a kernel of our own: a decode step of a few sequences is a chain of 1-4 row matrix products,
bound by how fast the weights stream from memory. On the AVX2 AMD EPYC dev machine oneDNN and MKL
stream them at 10-13 GB/s where the machine reads at ~21 GB/s; this 6x16 micro-kernel reaches ~20 GB/s
there and matches oneDNN's prepacked GEMM from 16 rows up (docs/engine.md has the measurements). Each
output is summed in one fixed order whatever the batch, so a request's logits do not depend on
its batch-mates (tested).

The source is compiled once (< 1 s, ``cc -O3 -mavx2 -mfma -fopenmp``) into
``$LLM_SERVE_CACHE/kernels`` under a hash of source, flags and compiler, and loaded with ctypes (no
torch headers, so no minute-long C++ extension build). It links ``libgomp.so.1``, the soname of
the OpenMP runtime torch's wheel ships and has already loaded, so the kernel runs on torch's own
thread team and follows ``torch.set_num_threads``. Where it cannot be built (no compiler, no
AVX2/FMA, not x86-64) :func:`load_avx2_gemm` returns None and callers keep oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from app.models.registry import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "linear_avx2.c"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_SUPPORTED_CAPABILITIES = ("AVX2", "AVX512")  # torch's own CPU dispatch level: both have AVX2 and FMA


class AVX2Gemm:
    """``pack`` a weight once; ``linear`` then computes ``x W^T + b`` from the packed panels."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.packed_weight_numel.argtypes, lib.packed_weight_numel.restype = [i64, i64], i64
        lib.pack_weight.argtypes, lib.pack_weight.restype = [ptr, ptr, i64, i64], None
        lib.linear.argtypes, lib.linear.restype = [ptr, ptr, ptr, ptr, i64, i64, i64], None
        self._lib = lib

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] fp32 -> the kernel's panels (a flat tensor of about the same size)."""
        weight = weight.detach().contiguous()
        n, k = weight.shape
        packed = torch.empty(self._lib.packed_weight_numel(n, k), dtype=torch.float32)
        self._lib.pack_weight(weight.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        in_features = x.shape[-1]
        rows = x.reshape(-1, in_features).contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
        if rows.shape[0]:
            bias_ptr = bias.detach().contiguous().data_ptr() if bias is not None else None
            self._lib.linear(rows.data_ptr(), packed.data_ptr(), bias_ptr, out.data_ptr(), rows.shape[0], in_features, out_features)
        return out.view(*x.shape[:-1], out_features)


@functools.cache
def load_avx2_gemm() -> AVX2Gemm | None:
    """The compiled kernel, or None (logged once) where this machine cannot build or run it."""
    reason = unsupported_reason()
    if reason is None:
        try:
            return AVX2Gemm(ctypes.CDLL(str(_build())))
        except subprocess.CalledProcessError as exc:
            reason = f"compiling {SOURCE.name} failed: {(exc.stderr or '').strip()[-500:]}"
        except (OSError, subprocess.SubprocessError) as exc:
            reason = f"building {SOURCE.name} failed: {exc}"
    logger.info("AVX2 GEMM kernel unavailable (%s): fp32 Linear layers use oneDNN", reason)
    return None


def unsupported_reason() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _SUPPORTED_CAPABILITIES:
        return f"torch reports CPU capability {capability}, not AVX2"
    if _compiler() is None:
        return "no C compiler (set CC or install gcc)"
    return None


def _compiler() -> list[str] | None:
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _build() -> Path:
    """Compile into the cache unless an identical build is there; concurrent builders race harmlessly."""
    compiler = _compiler()
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(_FLAGS).encode() + version.encode()).hexdigest()[:16]
    directory = _kernel_dir()
    library = directory / f"linear_avx2-{key}.so"
    if not library.exists():
        fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            subprocess.run([*compiler, *_FLAGS, str(SOURCE), "-o", partial], capture_output=True, text=True, check=True, timeout=120)
            os.replace(partial, library)  # atomic: another process never loads a half-written library
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return library


def _kernel_dir() -> Path:
    for directory in (cache_dir() / "kernels", Path(tempfile.gettempdir()) / "llm-serve-kernels"):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return directory
        except OSError:
            continue
    raise OSError("no writable directory for the compiled kernel")
