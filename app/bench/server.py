"""Start the real app as ``make serve`` does, for one configuration; wait until it answers, stop it after.

Used by the mode comparison so every mode is measured through the same path users take (Ray Serve,
HTTP, OpenAI API). Runs ``make serve``'s command (``python -m deployments.launch``: ``serve run`` on a local Ray
sized for one machine) as a subprocess, so this module never imports ray. The naive
transformers server (benchmarks/naive_server.py) is started the same way for ``peer --launch naive``.

The server starts as ``make serve`` starts it, with Serve's direct ingress on (``DIRECT_INGRESS_ENV``): the
ingress replica then serves HTTP on a port of its own besides the proxy's, and the benchmark sends its
requests there, where a streamed token skips the proxy's hop (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
# Serve's direct ingress (Ray >= 2.60): each ingress replica also serves HTTP itself, on a port from 30000 up
DIRECT_INGRESS_ENV = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
_DIRECT_PORT_LINE = re.compile(r"Started HTTP server on port (\d+)")
_DIRECT_PORT_WAIT_S = 60


@contextlib.contextmanager
def running_server(app_config: dict, port: int, log_path: Path, ready_timeout_s: float = 600,
                   code: Path | None = None) -> Iterator[str]:
    """Serve ``app_config`` (the dict a configs/*.yaml file holds) on ``port``; yields the base URL. ``code``: another
    checkout of this project to serve from (e.g. a git worktree of an earlier commit, for an A/B): ``serve run``
    imports the app from its working directory, and Ray's workers take the driver's import path."""
    code = code or ROOT
    env = {**os.environ, **DIRECT_INGRESS_ENV}
    if code != ROOT:  # ahead of this checkout's editable install
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "app.yaml"
        config_file.write_text(yaml.safe_dump(app_config))
        serve_file = Path(tmp) / "serve.yaml"
        serve_file.write_text(yaml.safe_dump(_serve_config(config_file, port)))
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [*_serve_command(code), str(serve_file)], cwd=code, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env=env,
            )
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_ready(url, process, ready_timeout_s, log_path)
                yield _direct_url(log_path, process) or url
            finally:
                _stop(process)


@contextlib.contextmanager
def running_naive_server(port: int, log_path: Path, served_name: str, dtype: str, checkpoint: str | None = None,
                         ready_timeout_s: float = 600) -> Iterator[str]:
    """benchmarks/naive_server.py on ``port`` (the embedded model's checkpoint unless ``checkpoint``); yields the URL."""
    command = [sys.executable, str(ROOT / "benchmarks" / "naive_server.py"), "--port", str(port), "--served-name", served_name,
               "--dtype", dtype]
    if checkpoint is None:
        from app.models.registry import BUILTIN_MODELS, prepare_builtin

        if served_name in BUILTIN_MODELS:
            checkpoint = str(prepare_builtin(served_name))
    if checkpoint is not None:
        command += ["--model", checkpoint]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, process, ready_timeout_s, log_path, "naive server")
            yield url
        finally:
            _stop(process)


def _serve_command(code: Path) -> list[str]:
    """``make serve``'s command in ``code``; ``serve run`` itself in a checkout from before the launcher."""
    if (code / "deployments" / "launch.py").exists():
        return [sys.executable, "-m", "deployments.launch"]
    return [str(Path(sys.executable).parent / "serve"), "run"]


def _serve_config(config_file: Path, port: int) -> dict:
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {"name": "default", "route_prefix": "/", "import_path": "deployments.builder:build_app",
             "args": {"config": str(config_file)}}
        ],
    }


def _wait_ready(url: str, process: subprocess.Popen, timeout_s: float, log_path: Path, what: str = "serve run") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}; see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"the server was not ready after {timeout_s:.0f}s; see {log_path}")


def _direct_url(log_path: Path, process: subprocess.Popen) -> str | None:
    """The ingress replica's own HTTP address, from its start-up line in ``serve run``'s log; None (the proxy's
    address serves then) where Serve started no such server, e.g. a Ray without direct ingress."""
    deadline = time.monotonic() + _DIRECT_PORT_WAIT_S
    while time.monotonic() < deadline and process.poll() is None:
        found = _DIRECT_PORT_LINE.search(log_path.read_text(errors="replace"))
        if found:
            url = f"http://127.0.0.1:{found.group(1)}"
            _wait_ready(url, process, _DIRECT_PORT_WAIT_S, log_path)
            return url
        time.sleep(1)
    print(f"no direct-ingress HTTP server in {log_path}: measuring through Serve's proxy", flush=True)
    return None


def _stop(process: subprocess.Popen) -> None:
    """Ctrl-C, as a user would: serve run then shuts Serve and its local Ray cluster down (uvicorn: the server)."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
