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
