"""``make test``: the whole suite as four pytest runs side by side, each on half of the cores.

The tiers on Ray (tests/serve on one local cluster; tests/deploy, which starts a two-node cluster of its own)
mostly wait on Serve: replicas starting, health checks, drains, autoscaling. The other two runs (tests/model and
tests/unit, split by time) mostly compute, at a lower priority. Side by side, the waits overlap the work. Each
run's torch, and every engine it starts, runs on half of the cores (``LLM_SERVE_TEST_THREADS``, read by
tests/conftest.py): OpenMP pools each as wide as the machine would stall each other at every parallel region.

The first computing run reports as it goes; the others' reports follow when they end. The exit status is the first
failure of any. A run still going after ``RUN_DEADLINE_S`` is interrupted (its fixtures stop what they started: Ray
clusters), then killed with everything it started, and fails, its output so far printed: a hang fails the suite with
its log, not the CI job's time limit without one. Ctrl-C reaches the first run from the terminal and the others from
here, the same way. Options (``-x``, ``-k EXPR``, ``--durations=N``) go to every run; to run chosen test files,
call pytest itself. On a single core, one pytest run of everything.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

RAY_TIER = ("tests/serve",)
CLUSTER_TESTS = ("tests/deploy",)  # a two-node Ray cluster of their own, started and stopped beside the rest
# The computing tests as two runs of about equal time (each alone on one thread, 2-core AVX2 EPYC: 216 s and 160 s
# with the zoo, ~30 s, in the first; it moved to the second): while the Ray runs wait on Serve, both cores compute,
# and neither run is left computing alone at the end. The files that use the fp32 server (tests/model/conftest.py's
# server_fp32, ~15 s to start) are all in the second run, so it starts once. A new file in tests/model goes there too.
FIRST_RUNS_MODEL_FILES = ("tests/model/test_quantized_models.py", "tests/model/test_speculative.py")
KERNEL_UNIT_TESTS = "tests/unit/cpu"
COMPUTE_TIERS = (
    ("tests/unit", f"--ignore={KERNEL_UNIT_TESTS}", *FIRST_RUNS_MODEL_FILES),
    ("tests/model", KERNEL_UNIT_TESTS, *(f"--ignore={path}" for path in FIRST_RUNS_MODEL_FILES)),
)
NO_TESTS = 5  # pytest's exit status when no test was selected
# The computing runs yield to the Ray runs: Serve's waits (replicas starting, health checks, drains) are on the
# suite's critical path and stretch when their processes queue behind compute. Ray starts its workers (Serve's
# controller, proxy and replicas, and the engine processes replicas spawn) at niceness 15 by default, level with
# the computing runs; here they start at 0 (RAY_worker_niceness). 2-core AVX2 EPYC, at a quick hour: 4:10-4:34
# wall against 5:00-5:03 with one computing run at niceness 5 and Ray's workers at 15 (the Ray tier then 4:31,
# 3:24 alone); at a slow one, alternated: 5:29 and 5:37 against 6:30 and 5:36. Computing at 15 instead of 5 is no
# faster, and leaves the computing runs' timed tests (heartbeats, drain windows) ~3% of a core while the Ray tier
# is busy, against ~25%.
COMPUTE_NICENESS = 5
RUN_DEADLINE_S = 30 * 60  # ~6x what the slowest run takes on a 2-core AVX2 EPYC
KILLED = 124  # a run's status when its deadline killed it (as timeout(1) says it)
TEARDOWN_S = 20  # an interrupted run's time to stop what it started before it is killed


def main(options: list[str]) -> int:
    from app.engine.host_cpus import usable_cpus  # the container's CPU quota counts, not only the affinity

    cores = usable_cpus()
    pytest = [sys.executable, "-m", "pytest", "-q", *options]
    if cores < 2:
        return subprocess.call(pytest)
    env = {**os.environ, "LLM_SERVE_TEST_THREADS": str(cores // 2), "RAY_worker_niceness": "0"}  # see above
    reported, *computing = COMPUTE_TIERS
    print(f"{', '.join(_name(paths) for paths in COMPUTE_TIERS + (RAY_TIER, CLUSTER_TESTS))} side by side, "
          f"{cores // 2} thread(s) each", flush=True)

    def run(paths: tuple[str, ...], niceness: int, own_group: bool, **output) -> subprocess.Popen:
        cache = f"cache_dir=.pytest_cache/{paths[0].split('/')[-1]}"  # each run's own last-failed record

        def start() -> None:
            if own_group:  # a background run: stopped with everything it started (the reported run keeps the terminal)
                os.setpgid(0, 0)
            os.nice(niceness)

        return subprocess.Popen([*pytest, "-o", cache, *paths], env=env, preexec_fn=start, **output)

    deadline = time.monotonic() + RUN_DEADLINE_S
    background = []
    with contextlib.ExitStack() as logs:
        try:
            for paths, niceness in [(p, COMPUTE_NICENESS) for p in computing] + [(RAY_TIER, 0), (CLUSTER_TESTS, 0)]:
                log = logs.enter_context(tempfile.TemporaryFile(mode="w+"))
                background.append((run(paths, niceness, True, stdout=log, stderr=subprocess.STDOUT), log, paths))
            first = run(reported, COMPUTE_NICENESS, False)  # reports as it goes
            statuses = [_wait(first, deadline, _name(reported), group=False)]
            for process, log, paths in background:
                statuses.append(_wait(process, deadline, _name(paths)))
                log.seek(0)
                print(f"\n---- {_name(paths)} ----", flush=True)
                sys.stdout.write(log.read())
        finally:  # done (what a run left behind goes), or interrupted: Ctrl-C passed on to the background runs
            for process, _, _ in background:
                _stop(process)
    return _combined(*statuses)


def _wait(process: subprocess.Popen, deadline: float, name: str, group: bool = True) -> int:
    try:
        return process.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        print(f"\n---- {name}: still running after {RUN_DEADLINE_S // 60} min, stopped ----", flush=True)
        _stop(process, group)
        return KILLED


def _stop(process: subprocess.Popen, group: bool = True) -> None:
    """Interrupt a run (pytest tears its fixtures down), give it ``TEARDOWN_S``, then kill it (and its group)."""
    def signal_run(signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signum) if group else process.send_signal(signum)

    if process.poll() is None:
        signal_run(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=TEARDOWN_S)
    signal_run(signal.SIGKILL)
    process.wait()


def _name(paths: tuple[str, ...]) -> str:
    """A run's name: its test paths, without the ones it leaves out."""
    return " ".join(path for path in paths if not path.startswith("--ignore="))


def _combined(*statuses: int) -> int:
    """The first failure; a run whose tests ``-k`` deselected all (pytest's 5) fails only if every run's did."""
    failed = [status for status in statuses if status not in (0, NO_TESTS)]
    return failed[0] if failed else (NO_TESTS if all(s == NO_TESTS for s in statuses) else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
