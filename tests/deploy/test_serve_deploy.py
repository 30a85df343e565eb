"""`serve deploy` on a Ray cluster of its own, as docs/deployment.md tells a user to run one.

The test starts a one-CPU head with ``ray start --head --block`` on free ports and its own temp dir, with
Serve's proxy on a free port too (so it neither meets nor changes a Ray that the same pytest session runs:
tests/serve's cluster, Serve on 8765), deploys build_app on the fake model with ``serve deploy``, waits for
``serve status`` to say RUNNING, sends one completion over HTTP, then ``serve shutdown -y``. It stops only the cluster it started: SIGTERM
to its ``ray start --block`` (which drains and stops that node's processes), then whatever is left of the
processes in that session. ``ray stop`` is not used: it stops every Ray on the machine.

Authentication (Ray 2.60): a head started by ``ray start`` turns token authentication on when a token is
available (``~/.ray/auth_token``, written by any earlier local ``ray.init()``), and the serve CLI then
only sends the token when ``RAY_AUTH_MODE=token`` is set; the test sets it exactly then, as the Makefile does.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
import yaml

pytestmark = pytest.mark.serve

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
APP = "deploy-test"
MODEL = "fake-a"
DEPLOY_TIMEOUT_S = 120
CLI_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def token_available(env: dict[str, str]) -> bool:
    """Whether Ray finds an auth token (its own lookup: variable, token path, then ~/.ray/auth_token)."""
    if env.get("RAY_AUTH_TOKEN"):
        return True
    if env.get("RAY_AUTH_TOKEN_PATH"):
        return pathlib.Path(env["RAY_AUTH_TOKEN_PATH"]).is_file()
    return (pathlib.Path(env.get("HOME", str(pathlib.Path.home()))) / ".ray" / "auth_token").is_file()


def cluster_env() -> dict[str, str]:
    """The environment of `ray start` and the serve CLI: no inherited cluster address, the repository on
    the workers' path (the fake model lives in tests/), RAY_AUTH_MODE=token exactly when a token exists."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if token_available(env):
        env["RAY_AUTH_MODE"] = "token"
    return env


def app_config(http_port: int) -> dict:
    """A serve_config.yaml-shaped file: build_app on one fake model, Serve's proxy on ``http_port``."""
    served = {"model": {"source": MODEL}, "engine": {"separate_process": False}, "replica": {"num_cpus": 0}}
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [
            {
                "name": APP,
                "route_prefix": "/",
                "import_path": "deployments.builder:build_app",
                "args": {"server_factory": "tests.serve.fake_model:fake_model_server", "models": [served]},
            }
        ],
    }


def session_processes(sid: int) -> list[int]:
    """Processes left in the session that `ray start` was started in (its own, by start_new_session)."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
    return pids


def stop_cluster(head: subprocess.Popen, grace_s: float = 30) -> None:
    with contextlib.suppress(ProcessLookupError):
        head.send_signal(signal.SIGTERM)  # `ray start --block` drains, then stops its node's processes
    with contextlib.suppress(subprocess.TimeoutExpired):
        head.wait(grace_s)
    deadline = time.monotonic() + 10
    while session_processes(head.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in session_processes(head.pid):  # workers that outlived their raylet
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if head.poll() is None:
        head.kill()
        head.wait(10)


@pytest.fixture
def ray_head():
    """A head node of this test's own; yields (dashboard address, env for the CLI, log path)."""
    if shutil.which("ray", path=str(BIN)) is None or sys.platform != "linux":
        pytest.skip("needs Ray's CLI next to this Python, on Linux")
    temp_dir = tempfile.mkdtemp(prefix="rd-", dir="/tmp")  # short: Ray's socket paths live under it
    env = cluster_env()
    dashboard = free_port()
    command = [
        str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=1", "--disable-usage-stats",
        f"--port={free_port()}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={free_port()}",
        f"--ray-client-server-port={free_port()}", f"--temp-dir={temp_dir}",
    ]  # fmt: skip
    log_path = pathlib.Path(temp_dir) / "ray-start.log"
    with open(log_path, "w") as log:
        head = subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield f"http://127.0.0.1:{dashboard}", env, log_path
    finally:
        stop_cluster(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def serve_cli(address: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "serve"), *args, "--address", address],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
    )  # fmt: skip


def wait_for_dashboard(address: str, log_path: pathlib.Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{address}/api/version", timeout=2).status_code in (200, 401, 403):
                return
        time.sleep(0.5)
    pytest.fail(f"the dashboard at {address} did not come up in {timeout_s} s:\n{log_path.read_text()[-3000:]}")


def app_status(address: str, env: dict[str, str]) -> tuple[str, str]:
    """(this app's status, the whole `serve status` output)."""
    result = serve_cli(address, env, "status")
    if result.returncode != 0:
        return "CLI_ERROR", result.stdout + result.stderr
    status = yaml.safe_load(result.stdout) or {}
    return (status.get("applications") or {}).get(APP, {}).get("status", "MISSING"), result.stdout


def test_serve_deploy_on_a_ray_start_cluster(ray_head, tmp_path):
    address, env, log_path = ray_head
    wait_for_dashboard(address, log_path)
    config = tmp_path / "serve_config.yaml"
    http_port = free_port()  # not tests/serve's 8765, nor anything else listening here
    config.write_text(yaml.safe_dump(app_config(http_port), sort_keys=False))

    if env.get("RAY_AUTH_MODE") == "token" and not env.get("RAY_AUTH_TOKEN"):
        # What docs/deployment.md warns about: with a token on disk, a CLI without RAY_AUTH_MODE=token is refused.
        bare = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
        refused = serve_cli(address, bare, "status")
        assert refused.returncode != 0 and "Authentication required" in refused.stdout + refused.stderr

    deployed = serve_cli(address, env, "deploy", str(config))
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    try:
        deadline = time.monotonic() + DEPLOY_TIMEOUT_S
        status, output = app_status(address, env)
        while status not in ("RUNNING", "DEPLOY_FAILED") and time.monotonic() < deadline:
            time.sleep(1)
            status, output = app_status(address, env)
        assert status == "RUNNING", output

        body = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
        reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == "hellohel"  # the fake model echoes the prompt
    finally:
        shutdown = serve_cli(address, env, "shutdown", "-y")
    assert shutdown.returncode == 0, shutdown.stdout + shutdown.stderr
