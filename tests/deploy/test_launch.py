"""``make serve``'s launcher (deployments/launch.py) for real: it starts a local Ray without the dashboard, with
Serve's controller on a 0.5 s loop, runs the config through ``serve run`` on it, and Ctrl-C stops all of it.

The app is the fake model hosted by the ingress (tests/deploy/cluster.py's config), behind Serve's proxy on a free
port; the launcher runs in a process session of its own, so every process it started can be found and checked.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import yaml

from deployments.launch import SERVE_ENV
from tests.deploy.cluster import MODEL, ROOT, app_config, cluster_env, free_port, session_processes

pytestmark = pytest.mark.serve

READY_TIMEOUT_S = 180  # a local Ray, Serve and the app on a loaded 2-core CI machine
STOP_TIMEOUT_S = 60


@pytest.fixture
def launched(tmp_path):
    """``python -m deployments.launch`` on the fake app; yields (its process, the proxy's URL, its log)."""
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(app_config(port)))
    log_path = tmp_path / "launch.log"
    env = {k: v for k, v in cluster_env().items() if k not in SERVE_ENV}  # the launcher's own defaults apply
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "deployments.launch", str(config)], cwd=ROOT, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield process, f"http://127.0.0.1:{port}", log_path
    finally:
        for pid in session_processes(process.pid):  # whatever a failed test left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(10)


def wait_until_serving(url: str, process: subprocess.Popen, log_path: pathlib.Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the launcher exited with {process.returncode}:\n{log_path.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(1)
    pytest.fail(f"not serving after {READY_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


def commands_and_environments(sid: int) -> list[tuple[str, dict[str, str]]]:
    found = []
    for pid in session_processes(sid):
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            found.append((" ".join(process.cmdline()), process.environ()))
    return found


def test_make_serve_runs_the_app_on_a_lean_local_ray_and_ctrl_c_stops_it(launched):
    process, url, log_path = launched
    wait_until_serving(url, process, log_path)

    answer = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"]

    started = commands_and_environments(process.pid)
    assert any("gcs_server" in command for command, _ in started)  # the launcher's own Ray, in its session
    # Ray keeps a dashboard process for its usage statistics alone: no web frontend, no module processes
    dashboards = [command for command, _ in started if "dashboard/dashboard.py" in command]
    assert all("--disable-frontend" in command for command in dashboards)
    assert not any("ray-dashboard-" in command for command, _ in started)
    controllers = [environ for command, environ in started if "ServeController" in command]
    assert controllers
    assert all(environ.get(name) == value for environ in controllers for name, value in SERVE_ENV.items())
    assert "Started HTTP server on port" in log_path.read_text()  # direct ingress: the replica's own port

    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal reaches the whole foreground group
    assert process.wait(STOP_TIMEOUT_S) == 0
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while session_processes(process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert session_processes(process.pid) == []
