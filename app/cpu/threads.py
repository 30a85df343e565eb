"""The engine's OpenMP threads kept one per CPU (``engine.cpu_threads_bind``; ``kernels/threads.c`` says why).

``auto`` binds thread i of the team to the i-th CPU this process may run on, when the team has exactly one thread per
such CPU: the engine then owns the cores it sees, as a replica that takes the machine does. A team smaller than that (a
container's CPU quota, ``engine.torch_threads`` set lower, several engines splitting a node) stays unbound, since which
cores are its own is not known here; so does an engine on a GPU. A CPU list (``"0-3,8"``) binds thread i to its i-th CPU
and sets the team to its length, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` does; ``none`` never binds.

The binding is made by the thread that runs the engine's steps, for its own team (libgomp keeps a team per calling
thread), after the model is loaded and warmed up; threads the engine starts later inherit its first CPU, unless
started inside ``spawning_unbound``.
"""

from __future__ import annotations

import contextlib
import logging
import os

from app.config.engine import THREADS_BIND_NONE, listed_cpus
from app.cpu.ops import OPS, load_ops

logger = logging.getLogger(__name__)
_allowed_before_binding: set[int] = set()  # what the engine's thread could run on before its team was bound


def binding_plan(setting: str, threads: int, allowed: list[int], device_type: str = "cpu") -> tuple[list[int] | None, str]:
    """The CPU of each of the ``threads`` threads, or None and why not (``allowed``: the CPUs this process may use)."""
    if setting == THREADS_BIND_NONE:
        return None, "not bound (engine.cpu_threads_bind: none)"
    cpus = listed_cpus(setting)
    if cpus is not None:
        outside = [cpu for cpu in cpus if cpu not in allowed]
        if outside:
            raise ValueError(f"engine.cpu_threads_bind names CPU {', '.join(map(str, outside))}, which this process may "
                             f"not run on (it may use {_ranges(allowed)})")
        if len(cpus) != threads:
            raise ValueError(f"engine.cpu_threads_bind names {len(cpus)} CPUs for {threads} threads (engine.torch_threads): "
                             "name one CPU per thread, or leave torch_threads at 0")
        return cpus, f"bound one per CPU to {_ranges(cpus)}"
    if device_type != "cpu":
        return None, f"not bound (the model runs on {device_type})"
    if threads != len(allowed):
        return None, (f"not bound: {threads} for the {len(allowed)} CPUs this process may use "
                      "(engine.cpu_threads_bind lists the CPUs to bind to)")
    return sorted(allowed), f"bound one per CPU to {_ranges(sorted(allowed))}"


def bind_engine_threads(setting: str, threads: int, device_type: str) -> str:
    """Bind the calling thread's OpenMP team as ``setting`` says; returns what was done, for the start-up log."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpus, description = binding_plan(setting, threads, allowed, device_type) if allowed else (None, "not bound (no CPU affinity on this OS)")
    if cpus is None:
        return description
    if (reason := load_ops()) is not None:
        return f"not bound: the CPU kernels, which bind them, are off ({reason})"
    _allowed_before_binding.update(allowed)
    bound = OPS.bind_threads(cpus)
    if bound != len(cpus):
        logger.warning("engine threads: %d of %d bound to their CPUs", bound, len(cpus))
        return f"{bound} of {len(cpus)} bound to their CPUs"
    return description


@contextlib.contextmanager
def spawning_unbound():
    """Threads started inside run on every CPU the engine's thread had before its team was bound, not on the one CPU
    it is bound to now (a thread inherits its creator's CPUs): a pool the engine starts late, llguidance's for
    grammar masks, spreads over the machine."""
    if not _allowed_before_binding or not hasattr(os, "sched_setaffinity"):
        yield
        return
    bound = os.sched_getaffinity(0)  # the calling thread's own
    os.sched_setaffinity(0, _allowed_before_binding)
    try:
        yield
    finally:
        os.sched_setaffinity(0, bound)


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], None
    for i, cpu in enumerate(cpus):
        start = cpu if start is None else start
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            parts.append(f"{start}-{cpu}" if cpu != start else str(cpu))
            start = None
    return ",".join(parts)
