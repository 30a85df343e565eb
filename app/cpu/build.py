"""Build the CPU kernels into one library of torch ops, once per machine, with the system compiler.

``kernels/*.c`` are compiled as C (``cc -O3 -mavx2 -mfma -fopenmp``) and ``csrc/ops.cpp``, which
registers them as ``torch.ops.llm_serve.*``, as C++ against torch's headers with the include paths,
ABI flag and language standard (C++20) of ``torch.utils.cpp_extension``; both are linked into one
shared library kept in ``$LLM_SERVE_CACHE/kernels`` under a hash of the sources, flags, compilers and
torch version (~15 s on 2 cores the first time, nothing after). The library links ``libgomp.so.1``,
the soname of the OpenMP runtime torch's wheel ships and has already loaded, so the kernels run on
torch's own thread team and follow ``torch.set_num_threads``. Where it cannot be built,
:func:`unsupported_reason` says why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils import cpp_extension

from app.engine import host_cpus
from app.models.registry import cache_dir

CPU_DIR = Path(__file__).parent
KERNELS_DIR = CPU_DIR / "kernels"
OPS_SOURCE = CPU_DIR / "csrc" / "ops.cpp"
C_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC"]
DISABLE_VARIABLE = "LLM_SERVE_CPU_KERNELS"  # 0: none of ours, as on a CPU they do not support (Linear: oneDNN or torch)
_SUPPORTED_CAPABILITIES = ("AVX2", "AVX512")  # torch's own CPU dispatch level: both have AVX2 and FMA
_TIMEOUT_S = 300


def unsupported_reason() -> str | None:
    """Why the kernels cannot (or must not) run here, or None where they can."""
    if os.environ.get(DISABLE_VARIABLE, "").strip().lower() in ("0", "off", "false", "no"):
        return f"turned off by {DISABLE_VARIABLE}={os.environ[DISABLE_VARIABLE]}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _SUPPORTED_CAPABILITIES:
        return f"torch reports CPU capability {capability}, not AVX2"
    if c_compiler() is None or cxx_compiler() is None:
        return "no C/C++ compiler (install gcc and g++, or set CC and CXX)"
    return None


def sources() -> list[Path]:
    return sorted(KERNELS_DIR.glob("*.c")) + [OPS_SOURCE]


def build_library() -> Path:
    """The ops library, compiled into the cache unless an identical build is there (builders race harmlessly)."""
    name = f"llm_serve_ops-{_build_key()}.so"
    directories = _kernel_dirs()
    for directory in directories:  # a read-only cache may still hold this build
        if (directory / name).exists() and _written_by_owner_alone(os.lstat(directory / name)):
            return directory / name
    directory = next((d for d in directories if os.access(d, os.W_OK | os.X_OK)), None)
    if directory is None:
        raise OSError(f"no writable directory for the compiled kernels (tried {', '.join(map(str, directories)) or 'none'})")
    library = directory / name
    with tempfile.TemporaryDirectory(dir=directory) as scratch, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        # the C++ file (torch's headers) takes most of the time: the C files compile beside it
        ops = pool.submit(_compile_ops, Path(scratch))
        objects = list(pool.map(lambda source: _compile_c(source, Path(scratch)), sorted(KERNELS_DIR.glob("*.c"))))
        objects.append(ops.result())
        partial = Path(scratch) / library.name
        _run([*cxx_compiler(), "-shared", "-fopenmp", *map(str, objects), "-o", str(partial), *_torch_link_flags()])
        os.chmod(partial, 0o755)  # whatever the umask: a library its group could write is never loaded
        os.replace(partial, library)  # atomic: another process never loads a half-written library
    return library


def _compile_c(source: Path, out_dir: Path) -> Path:
    target = out_dir / f"{source.stem}.o"
    _run([*c_compiler(), *C_FLAGS, "-c", str(source), "-o", str(target)])
    return target


def _compile_ops(out_dir: Path) -> Path:
    target = out_dir / "ops.o"
    _run([*cxx_compiler(), *_cxx_flags(), "-c", str(OPS_SOURCE), "-o", str(target)])
    return target


def _cxx_flags() -> list[str]:
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    # C++20: the standard torch.utils.cpp_extension compiles extensions with (torch's headers are built for it)
    return ["-O2", "-std=c++20", "-fPIC", "-w", abi, *includes]


def _torch_link_flags() -> list[str]:
    flags = []
    for path in cpp_extension.library_paths():
        flags += [f"-L{path}", f"-Wl,-rpath,{path}"]
    return [*flags, "-lc10", "-ltorch_cpu"]


@functools.cache
def build_id() -> str:
    """The kernels' build (a hash of the sources, flags, compilers and torch version), computed once per process."""
    return _build_key()


def _build_key() -> str:
    digest = hashlib.sha256()
    for source in sources():
        digest.update(source.name.encode() + source.read_bytes())
    # the compilers' whole command lines too: CC="cc -march=native" built elsewhere must not load here under this key
    c, cxx = c_compiler(), cxx_compiler()
    for part in (C_FLAGS, _cxx_flags(), c, cxx, [torch.__version__, _version(c), _version(cxx)]):
        digest.update(" ".join(part).encode())
    # ... and where those name machine options (-march=native, -mavx512f), the CPU: the same command on a CPU with
    # fewer extensions, sharing the cache (a shared volume, a baked image), would load a library that dies on an
    # illegal instruction
    if any(arg.startswith("-m") for arg in (*c, *cxx)):
        fields = host_cpus.cpuinfo_fields()  # its identity only: "cpu MHz" and the like change from start to start
        identity = [fields.get(name, "") for name in ("vendor_id", "cpu family", "model", "model name", "stepping", "CPU part")]
        digest.update(" ".join([*identity, *sorted(host_cpus.cpu_flags() or ())]).encode())
    return digest.hexdigest()[:16]


def _version(compiler: list[str]) -> str:
    return subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout


def _run(command: list[str]) -> None:
    subprocess.run(command, capture_output=True, text=True, check=True, timeout=_TIMEOUT_S)


def c_compiler() -> list[str] | None:
    return _compiler("CC", ("cc", "gcc", "clang"))


def cxx_compiler() -> list[str] | None:
    return _compiler("CXX", ("c++", "g++", "clang++"))


def _compiler(variable: str, names: tuple[str, ...]) -> list[str] | None:
    if os.environ.get(variable):
        return shlex.split(os.environ[variable])
    for name in names:
        if found := shutil.which(name):
            return [found]
    return None


def _kernel_dirs() -> list[Path]:
    """Where the compiled kernels may be: the cache, then a folder of this user's own in the temp directory (a read-only
    home). Never a folder other users can write (the cache's too: ``LLM_SERVE_CACHE`` may name a shared one): a
    library planted there would be loaded and run."""
    found = []
    cache = cache_dir() / "kernels"
    private = Path(tempfile.gettempdir()) / f"llm-serve-kernels-{os.getuid()}"
    for directory in (cache, private):
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if _trusted(directory):
            found.append(directory)
    return found


def _trusted(directory: Path) -> bool:
    """Writable by this user or root alone (an image's cache, built as root, serves a user without a compiler), no
    symlink (its target could be swapped), and under no folder anyone may write but /tmp's kind (sticky)."""
    if not _written_by_owner_alone(os.lstat(directory)):
        return False
    return all(not (mode := os.stat(parent).st_mode) & stat.S_IWOTH or mode & stat.S_ISVTX for parent in directory.parents)


def _written_by_owner_alone(info: os.stat_result) -> bool:
    """A file or folder (not a link) of this user's or root's that neither its group nor others can write."""
    return (not stat.S_ISLNK(info.st_mode) and info.st_uid in (os.getuid(), 0)
            and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
