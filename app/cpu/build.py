"""Our C kernels for AVX2 CPUs (``app/engine/kernels/*.c``), compiled with the system C compiler at first use.

Each source is compiled once (< 1 s, ``cc -O3 -mavx2 -mfma -fopenmp``) into ``$LLM_SERVE_CACHE/kernels``
under a hash of source, flags and compiler, and loaded with ctypes: no torch headers, so no
minute-long C++ extension build. The libraries link ``libgomp.so.1``, the soname of the OpenMP
runtime torch's wheel ships and has already loaded, so the kernels run on torch's own thread team
and follow ``torch.set_num_threads``. Where a kernel cannot be built (no compiler, no AVX2/FMA, not
x86-64) :func:`load_library` returns None, logs why once, and callers keep torch's kernels.
"""

from __future__ import annotations

import contextlib
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
from torch.profiler import record_function

from app.models.registry import cache_dir

logger = logging.getLogger(__name__)

KERNELS_DIR = Path(__file__).parent / "kernels"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_SUPPORTED_CAPABILITIES = ("AVX2", "AVX512")  # torch's own CPU dispatch level: both have AVX2 and FMA


@functools.cache
def load_library(name: str) -> ctypes.CDLL | None:
    """``kernels/<name>.c`` compiled and loaded, or None (logged once) where this machine cannot."""
    reason = unsupported_reason()
    if reason is None:
        try:
            return ctypes.CDLL(str(build(KERNELS_DIR / f"{name}.c")))
        except subprocess.CalledProcessError as exc:
            reason = f"compiling {name}.c failed: {(exc.stderr or '').strip()[-500:]}"
        except (OSError, subprocess.SubprocessError) as exc:
            reason = f"building {name}.c failed: {exc}"
    logger.info("CPU kernel %s unavailable (%s): torch's kernels run instead", name, reason)
    return None


def profiler_label(name: str):
    """Context naming a kernel call in torch's profiler (ctypes calls are invisible to it).

    Only while the profiler records: the label costs a few microseconds, and a decode step makes ~200 calls.
    """
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def unsupported_reason() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _SUPPORTED_CAPABILITIES:
        return f"torch reports CPU capability {capability}, not AVX2"
    if _compiler() is None:
        return "no C compiler (set CC or install gcc)"
    return None


def build(source: Path) -> Path:
    """Compile ``source`` into the cache unless an identical build is there; concurrent builders race harmlessly."""
    compiler = _compiler()
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    key = hashlib.sha256(source.read_bytes() + " ".join(_FLAGS).encode() + version.encode()).hexdigest()[:16]
    directory = _kernel_dir()
    library = directory / f"{source.stem}-{key}.so"
    if not library.exists():
        fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            subprocess.run([*compiler, *_FLAGS, str(source), "-o", partial], capture_output=True, text=True, check=True, timeout=120)
            os.replace(partial, library)  # atomic: another process never loads a half-written library
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return library


def _compiler() -> list[str] | None:
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _kernel_dir() -> Path:
    for directory in (cache_dir() / "kernels", Path(tempfile.gettempdir()) / "llm-serve-kernels"):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return directory
        except OSError:
            continue
    raise OSError("no writable directory for the compiled kernels")
