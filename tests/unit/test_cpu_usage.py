"""The benchmark's CPU accounting: roles read from Ray's process titles, seconds from real processes."""

import subprocess
import sys
import time

from app.bench.cpu_usage import cpu_seconds_by_part, process_cpu_snapshot, role_of


def test_processes_are_grouped_by_their_serve_role():
    assert role_of("ray::ServeReplica:default:LLMServer:smollm2-135m-instruct", "raylet") == "replica"
    assert role_of("ray::ServeReplica:default:OpenAIIngress", "raylet") == "ingress"
    assert role_of("ray::ProxyActor", "raylet") == "proxy"
    assert role_of("ray::ServeController.listen_for_change", "raylet") == "controller"
    engine_core = "python -B -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)"
    assert role_of(engine_core, "ray::ServeReplica:default:LLMServer:smollm2-135m-instruct") == "engine core"
    assert role_of(engine_core, "ray::ServeReplica:default:OpenAIIngress") == "engine core"  # the model the ingress hosts
    assert role_of("gcs_server --log_dir=/tmp/ray", "bash") == "other (Ray, system)"


def test_cpu_spent_between_snapshots_is_counted_for_the_process_that_spent_it():
    before = process_cpu_snapshot()
    busy = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\ninput()"
    child = subprocess.Popen([sys.executable, "-c", busy], stdin=subprocess.PIPE)
    deadline = time.monotonic() + 60
    try:
        while True:  # until the child has burnt its half second of CPU and waits on its stdin
            after = process_cpu_snapshot()
            if after.get(child.pid, ("", 0.0))[1] >= 0.5:
                break
            assert child.poll() is None and time.monotonic() < deadline, "the busy child did not run"
            time.sleep(0.05)
        spent = cpu_seconds_by_part(before, after)
        assert spent["other (Ray, system)"] >= 0.5  # the child started after `before`: counted whole
        assert list(spent.values()) == sorted(spent.values(), reverse=True)  # largest part first
    finally:
        child.communicate(b"\n", timeout=30)
