"""The engine's OpenMP threads one per CPU (``app/cpu/threads.py``, ``kernels/threads.c``): the plan for each setting,
and the binding itself, read back from /proc in a process of its own (a bound test process would pin later tests)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.config.engine import EngineConfig, listed_cpus
from app.cpu.ops import unavailable_reason
from app.cpu.threads import binding_plan

ROOT = Path(__file__).resolve().parents[3]


def test_a_cpu_list_reads_as_vllm_reads_one():
    assert listed_cpus("0-3,8") == [0, 1, 2, 3, 8]
    assert listed_cpus("5,1-2,2") == [5, 1, 2]  # in the order given, each once
    assert listed_cpus("auto") is None and listed_cpus("none") is None


@pytest.mark.parametrize("setting", ["0-", "a", "3-1", "1,,2", "-1"])
def test_a_malformed_cpu_list_is_refused_at_load(setting):
    with pytest.raises(ValueError, match="engine.cpu_threads_bind must be auto, none or a CPU list"):
        EngineConfig(cpu_threads_bind=setting)


def test_a_list_and_a_thread_count_that_disagree_are_refused():
    with pytest.raises(ValueError, match="names 2 CPUs and engine.torch_threads asks for 3"):
        EngineConfig(cpu_threads_bind="0-1", torch_threads=3)
    assert EngineConfig(cpu_threads_bind=" 0-1 ", torch_threads=2).cpu_threads_bind == "0-1"


def test_auto_binds_a_team_with_one_thread_per_cpu_it_may_use():
    assert binding_plan("auto", 4, [2, 3, 4, 5]) == ([2, 3, 4, 5], "bound one per CPU to 2-5")


@pytest.mark.parametrize("threads, device, why", [
    (2, "cpu", "not bound: 2 for the 4 CPUs"),  # which two are its own is not known
    (4, "cuda", "not bound (the model runs on cuda)"),
])
def test_auto_leaves_a_team_unbound_where_its_cores_are_not_known_to_be_its_own(threads, device, why):
    cpus, said = binding_plan("auto", threads, [0, 1, 2, 3], device)
    assert cpus is None and said.startswith(why)


def test_none_never_binds_and_a_list_binds_in_its_order_even_on_a_gpu():
    assert binding_plan("none", 2, [0, 1])[0] is None
    assert binding_plan("3,1", 2, [0, 1, 2, 3], "cuda") == ([3, 1], "bound one per CPU to 3,1")


def test_a_list_naming_a_cpu_the_process_may_not_use_is_an_error_that_names_it():
    with pytest.raises(ValueError, match="names CPU 7, which this process may not run on .it may use 0-3."):
        binding_plan("0,7", 2, [0, 1, 2, 3])


_READ_BACK = """
import json, os, torch
from app.cpu.threads import bind_engine_threads

def affinities():
    tasks = {}
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/status") as status:
            tasks[task] = next(line for line in status if line.startswith("Cpus_allowed_list")).split(":")[1].strip()
    return tasks

allowed = sorted(os.sched_getaffinity(0))
torch.set_num_threads(len(allowed))
torch.ones(1 << 22).sum()  # the team exists before it is bound, as after an engine's warm-up
before = affinities()[str(os.getpid())]
seen = {}
for setting in ("none", "auto"):  # none first: a binding, once made, stays
    said = bind_engine_threads(setting, len(allowed), "cpu")
    torch.ones(1 << 22).sum()  # torch's own parallel region: the same team
    tasks = affinities()
    seen[setting] = {"said": said, "allowed": allowed, "before": before, "main": tasks[str(os.getpid())], "tasks": tasks}


def spawned_cpus(unbound):  # the CPUs of a thread the bound engine thread starts, inside spawning_unbound or not
    import contextlib, threading
    from app.cpu.threads import spawning_unbound

    box = {}
    with spawning_unbound() if unbound else contextlib.nullcontext():
        thread = threading.Thread(target=lambda: box.update(cpus=sorted(os.sched_getaffinity(0))))
        thread.start()
    thread.join()
    return box["cpus"]


seen["spawned"] = {"unbound": spawned_cpus(True), "inherited": spawned_cpus(False), "main": affinities()[str(os.getpid())]}
print(json.dumps(seen))
"""


def _bound_threads() -> dict:
    """Each setting's read-back, ``none`` then ``auto``, then threads started after it, in one child process (importing
    torch is most of its time)."""
    done = subprocess.run([sys.executable, "-c", _READ_BACK], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"the binding is made by the CPU kernels: {unavailable_reason()}")
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no per-thread CPU affinity on this OS")
def test_each_thread_of_the_team_runs_on_its_own_cpu_and_nothing_else_is_bound():
    both = _bound_threads()
    seen, unbound = both["auto"], both["none"]
    allowed = [str(cpu) for cpu in seen["allowed"]]
    assert seen["said"].startswith("bound one per CPU")
    single = sorted(cpus for cpus in seen["tasks"].values() if cpus in allowed)
    assert single == sorted(allowed)  # one thread per CPU: the team, the calling thread first
    assert seen["main"] == allowed[0]
    if len(allowed) > 1:  # the process's other threads keep every CPU; with none, every thread does
        assert all(cpus == seen["before"] for cpus in seen["tasks"].values() if cpus not in allowed)
        assert unbound["said"].startswith("not bound") and unbound["main"] != allowed[0]
        assert all(cpus == unbound["before"] for cpus in unbound["tasks"].values())
    # a thread the engine starts late (llguidance's pool) gets every CPU inside spawning_unbound; the engine's stays bound
    spawned = both["spawned"]
    assert spawned["unbound"] == seen["allowed"] and spawned["inherited"] == seen["allowed"][:1]
    assert spawned["main"] == allowed[0]
