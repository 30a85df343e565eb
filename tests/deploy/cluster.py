"""Running a Ray cluster of our own for the deploy tests, as docs/deployment.md tells a user to run one.

Heads start with ``ray start --head --block`` on free ports and their own temp dir, with Serve's proxy on a
free port too (so they neither meet nor change a Ray that the same pytest session runs: tests/serve's
cluster, Serve on 8765); apps go on with ``serve deploy`` and are watched with ``serve status``. Only the
cluster a test started is stopped: every process in the session of its ``ray start --block`` is killed.
``ray stop`` is not used: it stops every Ray on the machine.

Authentication (Ray 2.60): a head started by ``ray start`` turns token authentication on when a token is
available (``~/.ray/auth_token``, written by any earlier local ``ray.init()``), and the serve CLI then
only sends the token when ``RAY_AUTH_MODE=token`` is set; the tests set it exactly then, as the Makefile does.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

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


def cluster_env() -> dict[str, str]:
    """The environment of `ray start` and the serve CLI: no inherited cluster address, the repository on the
    workers' path (the fake model lives in tests/), and token authentication with a token of this cluster's own.
    Left to Ray, the head turns authentication on if ~/.ray/auth_token exists as it starts, which the serve tier's
    first ray.init() may be writing at that very moment on a fresh machine, while the joining node and the CLI
    decide by the environment alone."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return env


def app_config(http_port: int, app: str = APP, replica: dict | None = None) -> dict:
    """A serve_config.yaml-shaped file: build_app on one fake model, Serve's proxy on ``http_port``."""
    served = {"model": {"source": MODEL}, "engine": {"separate_process": False}, "replica": replica or {"num_cpus": 0}}
    return {
        "proxy_location": "HeadOnly",  # one proxy: a cluster's nodes here share this machine's ports
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [
            {
                "name": app,
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


def stop_cluster(head: subprocess.Popen) -> None:
    """Every process of the node's session killed at once: the node is the test's own, and nothing on it needs to
    end cleanly (a SIGTERM to ``ray start --block`` first drains what runs there, tens of seconds on two cores)."""
    for _ in range(3):  # a process forked while the others were being killed is caught by the next pass
        for pid in {head.pid, *session_processes(head.pid)}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    head.wait(30)  # once, with the whole suite running, the head's own process outlived a 10 s wait after its kill


def serve_cli(address: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "serve"), *args, "--address", address],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
    )  # fmt: skip


def dashboard_up(address: str) -> bool:
    """Whether the head's dashboard answers (401/403: it does, asking for the cluster's token)."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{address}/api/version", timeout=2).status_code in (200, 401, 403)
    return False


def app_status(address: str, env: dict[str, str], app: str = APP) -> tuple[str, str]:
    """(the app's status, the whole `serve status` output)."""
    result = serve_cli(address, env, "status")
    if result.returncode != 0:
        return "CLI_ERROR", result.stdout + result.stderr
    status = yaml.safe_load(result.stdout) or {}
    return (status.get("applications") or {}).get(app, {}).get("status", "MISSING"), result.stdout
