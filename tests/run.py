"""``make test``: the whole suite as two pytest runs side by side, each on half of the cores.

One half is the tiers on a Ray cluster (tests/serve, tests/deploy), which mostly wait on Serve: replicas starting,
health checks, drains, autoscaling delays. The other (tests/model, tests/unit) mostly computes. Side by side, one's
waits overlap the other's work. Each half's torch, and every engine it starts, runs on half of the cores
(``LLM_SERVE_TEST_THREADS``, read by tests/conftest.py): two OpenMP pools each as wide as the machine would stall
each other at every parallel region.

The computing half reports as it goes; the Ray half's report follows when it ends. The exit status is the first
failure of either. Options (``-x``, ``-k EXPR``, ``--durations=N``) go to both runs; to run chosen test files,
call pytest itself. On a single core, one pytest run of everything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

RAY_HALF = ("tests/serve", "tests/deploy")
COMPUTE_HALF = ("tests/model", "tests/unit")
NO_TESTS = 5  # pytest's exit status when no test was selected
COMPUTE_NICENESS = 5


def main(options: list[str]) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    pytest = [sys.executable, "-m", "pytest", "-q", *options]
    if cores < 2:
        return subprocess.call(pytest)
    env = {**os.environ, "LLM_SERVE_TEST_THREADS": str(cores // 2)}
    print(f"{' '.join(COMPUTE_HALF)} and {' '.join(RAY_HALF)} side by side, {cores // 2} thread(s) each", flush=True)
    with tempfile.TemporaryFile(mode="w+") as ray_log:
        ray_run = subprocess.Popen([*pytest, "-o", "cache_dir=.pytest_cache/ray", *RAY_HALF], env=env,
                                   stdout=ray_log, stderr=subprocess.STDOUT)
        compute_status = subprocess.call([*pytest, "-o", "cache_dir=.pytest_cache/compute", *COMPUTE_HALF], env=env,
                                         preexec_fn=_yield_to_the_ray_half)
        ray_status = ray_run.wait()
        ray_log.seek(0)
        print(f"\n---- {' '.join(RAY_HALF)} ----", flush=True)
        sys.stdout.write(ray_log.read())
    return _combined(compute_status, ray_status)


def _yield_to_the_ray_half() -> None:
    """The computing half runs at a lower priority: the Ray half is the longer one, and its waits on Serve (replicas
    starting, health checks, drains) stretch when its processes queue behind the other half's compute."""
    os.nice(COMPUTE_NICENESS)


def _combined(*statuses: int) -> int:
    """The first failure; a half whose tests ``-k`` deselected all (pytest's 5) fails only if both did."""
    failed = [status for status in statuses if status not in (0, NO_TESTS)]
    return failed[0] if failed else (NO_TESTS if all(s == NO_TESTS for s in statuses) else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
