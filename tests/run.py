"""``make test``: the whole suite as three pytest runs side by side, each on half of the cores.

The tiers on Ray (tests/serve on one local cluster; tests/deploy, which starts a two-node cluster of its own)
mostly wait on Serve: replicas starting, health checks, drains, autoscaling. The other run (tests/model,
tests/unit) mostly computes. Side by side, the waits overlap the work. Each run's torch, and every engine it
starts, runs on half of the cores (``LLM_SERVE_TEST_THREADS``, read by tests/conftest.py): two OpenMP pools each
as wide as the machine would stall each other at every parallel region.

The computing run reports as it goes; the Ray runs' reports follow when they end. The exit status is the first
failure of any. Options (``-x``, ``-k EXPR``, ``--durations=N``) go to every run; to run chosen test files,
call pytest itself. On a single core, one pytest run of everything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

RAY_TIER = ("tests/serve",)
CLUSTER_TESTS = ("tests/deploy",)  # a two-node Ray cluster of their own, started and stopped beside the rest
COMPUTE_TIERS = ("tests/model", "tests/unit")
NO_TESTS = 5  # pytest's exit status when no test was selected
COMPUTE_NICENESS = 5


def main(options: list[str]) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    pytest = [sys.executable, "-m", "pytest", "-q", *options]
    if cores < 2:
        return subprocess.call(pytest)
    env = {**os.environ, "LLM_SERVE_TEST_THREADS": str(cores // 2)}
    runs = [COMPUTE_TIERS, RAY_TIER, CLUSTER_TESTS]
    print(f"{', '.join(' '.join(paths) for paths in runs)} side by side, {cores // 2} thread(s) each", flush=True)
    with tempfile.TemporaryFile(mode="w+") as ray_log, tempfile.TemporaryFile(mode="w+") as cluster_log:
        ray_run = subprocess.Popen([*pytest, "-o", "cache_dir=.pytest_cache/ray", *RAY_TIER], env=env,
                                   stdout=ray_log, stderr=subprocess.STDOUT)
        cluster_run = subprocess.Popen([*pytest, "-o", "cache_dir=.pytest_cache/cluster", *CLUSTER_TESTS], env=env,
                                       stdout=cluster_log, stderr=subprocess.STDOUT)
        compute_status = subprocess.call([*pytest, "-o", "cache_dir=.pytest_cache/compute", *COMPUTE_TIERS], env=env,
                                         preexec_fn=_yield_to_the_ray_runs)
        statuses = [compute_status]
        for run, log, paths in ((ray_run, ray_log, RAY_TIER), (cluster_run, cluster_log, CLUSTER_TESTS)):
            statuses.append(run.wait())
            log.seek(0)
            print(f"\n---- {' '.join(paths)} ----", flush=True)
            sys.stdout.write(log.read())
    return _combined(*statuses)


def _yield_to_the_ray_runs() -> None:
    """The computing run goes at a lower priority: the Ray runs' waits on Serve (replicas starting, health checks,
    drains) stretch when their processes queue behind its compute."""
    os.nice(COMPUTE_NICENESS)


def _combined(*statuses: int) -> int:
    """The first failure; a run whose tests ``-k`` deselected all (pytest's 5) fails only if every run's did."""
    failed = [status for status in statuses if status not in (0, NO_TESTS)]
    return failed[0] if failed else (NO_TESTS if all(s == NO_TESTS for s in statuses) else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
