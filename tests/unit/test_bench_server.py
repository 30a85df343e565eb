"""The benchmark launcher finds the ingress replica's own HTTP server (Serve's direct ingress) in serve run's log."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.bench import server


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


class _Process:
    def __init__(self, returncode: int | None):
        self.returncode = returncode

    def poll(self):
        return self.returncode


@pytest.fixture
def health_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()


def test_direct_url_is_the_port_the_replica_logged(tmp_path, health_server):
    log = tmp_path / "serve.log"
    log.write_text("proxy starting on 8000\n(ServeReplica pid=1) INFO -- Started HTTP server on port "
                   f"{health_server}\n")
    assert server._direct_url(log, _Process(None)) == f"http://127.0.0.1:{health_server}"


def test_no_direct_server_means_the_proxy(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("proxy starting on 8000\n")
    assert server._direct_url(log, _Process(0)) is None  # serve run gone: no waiting for a line that cannot come


class _Popen:
    """serve run, not started: what it would have been started with."""
    started: list[dict] = []

    def __init__(self, command, **options):
        _Popen.started.append({"command": command, **options})
        self.returncode = None


@pytest.mark.parametrize("other_checkout", [False, True])
def test_serve_run_imports_the_app_from_the_checkout_it_is_given(tmp_path, monkeypatch, other_checkout):
    """An A/B of two versions (``peer --launch ours --code DIR``): serve run starts in that checkout, and the checkout
    comes first on the import path of serve run and of Ray's workers, ahead of this checkout's editable install. It
    starts as ``make serve`` starts it there: through the launcher, or ``serve run`` itself in a checkout without one."""
    monkeypatch.setattr(server.subprocess, "Popen", _Popen)
    monkeypatch.setattr(server, "_wait_ready", lambda *args: None)
    monkeypatch.setattr(server, "_direct_url", lambda *args: None)
    monkeypatch.setattr(server, "_stop", lambda process: None)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    _Popen.started.clear()
    code = tmp_path / "earlier" if other_checkout else None
    with server.running_server({"models": []}, 8100, tmp_path / "serve.log", code=code) as url:
        assert url == "http://127.0.0.1:8100"
    started = _Popen.started[0]
    assert started["cwd"] == (code or server.ROOT)
    serve_run = [str(server.Path(server.sys.executable).parent / "serve"), "run"]
    launcher = [server.sys.executable, "-m", "deployments.launch"]
    assert started["command"][:-1] == (serve_run if other_checkout else launcher)
    expected = f"{code}{server.os.pathsep}/elsewhere" if other_checkout else "/elsewhere"
    assert started["env"]["PYTHONPATH"] == expected and started["env"]["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"


def test_peer_launch_ours_reads_the_config_from_the_checkout_it_serves(tmp_path, monkeypatch):
    from app.bench import __main__ as bench
    from app.bench.cli import build_parser

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "smollm2-cpu.yaml").write_text("models: [{model: {source: earlier}}, {model: {source: second}}]\n")
    seen = {}
    monkeypatch.setattr(server, "running_server", lambda config, port, log, code=None: seen.update(config=config, code=code))
    args = build_parser("").parse_args(["peer", "--launch", "ours", "--name", "ours@earlier", "--code", str(tmp_path)])
    bench._launched(args)
    assert seen == {"config": {"models": [{"model": {"source": "earlier"}}]}, "code": tmp_path}
