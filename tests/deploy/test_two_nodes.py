"""One model's replicas on two Ray nodes: ``replica.max_replicas_per_node: 1`` spreads them, the proxy serves both.

Two nodes on this machine, each from its own ``ray start --block`` in a process session of its own: a head
(one CPU, custom resource ``node_a``, dashboard and GCS on free ports) and a node that joins it with
``ray start --address=<head GCS>`` (one CPU, ``node_b``, its own free ports). ``serve deploy`` puts the fake
model, hosted by the ingress, on 2 replicas at most 1 per node; Serve's own view of the application (the
dashboard's ``/api/serve/applications/``, the same data as ``serve status``) must place one replica on each
node, and completions sent to the proxy on the head must all come back right, those served across the nodes
included. Only these two nodes are stopped at the end (by process id, never ``ray stop``); the helpers are
tests/deploy/cluster.py's. It is also the test of ``serve deploy`` / ``serve status`` on a ``ray start`` cluster.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx
import pytest
import yaml

from tests.deploy.cluster import (
    BIN, ROOT, app_config, app_status, cluster_env, dashboard_up, free_port, serve_cli, stop_cluster,
)  # fmt: skip

pytestmark = pytest.mark.serve

APP = "two-nodes"
MODEL = "fake-a"
NODE_RESOURCES = ("node_a", "node_b")  # one custom resource per node: which node is which
DEPLOY_TIMEOUT_S = 180  # the poll returns once RUNNING: slack for a loaded, slower CI machine
NUM_REQUESTS = 16


NODE_ATTEMPTS = 3
NODE_START_TIMEOUT_S = 180  # one attempt, on a loaded 2-core CI machine


def start_node(command: list[str], env: dict[str, str], log_path: pathlib.Path) -> subprocess.Popen:
    with open(log_path, "a") as log:
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_until_up(command: Callable[[], list[str]], env: dict[str, str], log_path: pathlib.Path,
                   up: Callable[[], bool], what: str) -> subprocess.Popen:
    """Start a node (``command()``: its own ports fresh each time) until ``up()``, again if its start fails: a node's
    raylet gives its dashboard agent ~15 s to report its ports and gives up on the node past that, and on a 2-core
    machine busy with the rest of the suite the agent's imports alone have taken that long. A start that fails so is
    Ray's start-up race, not the deployment under test; one still going at the deadline fails the test."""
    for _ in range(NODE_ATTEMPTS):
        node, deadline = start_node(command(), env, log_path), time.monotonic() + NODE_START_TIMEOUT_S
        while node.poll() is None and time.monotonic() < deadline:
            if up():
                return node
            time.sleep(0.5)
        failed = node.poll() is not None  # rather than still starting at the deadline: no second try then
        stop_cluster(node)
        if not failed:
            break
    pytest.fail(f"{what} did not start:\n{log_path.read_text()[-3000:]}")


@pytest.fixture
def two_nodes():
    """A head and a second node joined to it; yields (dashboard address, env for the CLI, the Ray temp dir)."""
    if shutil.which("ray", path=str(BIN)) is None or sys.platform != "linux":
        pytest.skip("needs Ray's CLI next to this Python, on Linux")
    temp_dir = tempfile.mkdtemp(prefix="r2-", dir="/tmp")  # short: Ray's socket paths live under it
    env = cluster_env()
    # Serve's proxy would send every request to the replica on its own node while that one has room: here the
    # head's proxy picks between both replicas, so requests also cross to the other node.
    env["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"
    dashboard, gcs = free_port(), free_port()
    common = ["--block", "--num-cpus=1", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
              f"--temp-dir={temp_dir}"]  # fmt: skip

    def own_ports() -> list[str]:  # every port a node listens on, free ones: two nodes share this machine
        return [f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]  # fmt: skip

    address = f"http://127.0.0.1:{dashboard}"
    head = worker = None
    try:
        head = start_until_up(
            lambda: [str(BIN / "ray"), "start", "--head", *common, *own_ports(), f"--port={gcs}", "--resources",
                     json.dumps({"node_a": 1}), "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                     f"--dashboard-port={dashboard}", f"--ray-client-server-port={free_port()}"],
            env, pathlib.Path(temp_dir) / "head.log", lambda: dashboard_up(address), "the head",
        )  # fmt: skip
        worker = start_until_up(  # the head is up: its GCS takes the second node
            lambda: [str(BIN / "ray"), "start", f"--address=127.0.0.1:{gcs}", *common, *own_ports(), "--resources",
                     json.dumps({"node_b": 1})],
            env, pathlib.Path(temp_dir) / "worker.log", lambda: _joined(address, env), "the second node",
        )  # fmt: skip
        yield address, env, pathlib.Path(temp_dir)
    finally:
        for node in (worker, head):  # the joined node first, then the head (its own session each)
            if node is not None:
                stop_cluster(node)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _joined(address: str, env: dict[str, str]) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return len(alive_nodes(address, env)) == 2
    return False


def auth_headers(env: dict[str, str]) -> dict[str, str]:
    """The token header the dashboard asks for when the cluster runs with token authentication (as the CLI sends it)."""
    if env.get("RAY_AUTH_MODE") != "token":
        return {}
    home = pathlib.Path(env.get("HOME", str(pathlib.Path.home())))
    token = env.get("RAY_AUTH_TOKEN") or (home / ".ray" / "auth_token").read_text()
    return {"Authorization": f"Bearer {token.strip()}"}


def placement(address: str, env: dict[str, str], timeout_s: float) -> dict:
    """Serve's view of the app once it is RUNNING or failed (or ``timeout_s`` passed), with every alive node's custom
    resources: the dashboard's REST API, which ``serve status`` and ``ray list nodes`` read, polled from here (a
    driver of this cluster would cost a process and seconds of imports)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=address, headers=auth_headers(env), timeout=10) as http:
        while True:
            details = http.get("/api/serve/applications/")
            details.raise_for_status()
            application = details.json().get("applications", {}).get(APP, {})
            if application.get("status") in ("RUNNING", "DEPLOY_FAILED") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    replicas = [
        {"deployment": name, "state": r["state"], "node_id": r.get("node_id"), "log": r.get("log_file_path")}
        for name, deployment in application.get("deployments", {}).items() for r in deployment.get("replicas", [])
    ]
    nodes = {n["node_id"]: sorted(n["resources_total"]) for n in alive_nodes(address, env)}
    return {"status": application.get("status"), "replicas": replicas, "nodes": nodes}


def alive_nodes(address: str, env: dict[str, str]) -> list[dict]:
    """The cluster's alive nodes, as the dashboard's REST API lists them (``ray list nodes`` reads the same)."""
    with httpx.Client(base_url=address, headers=auth_headers(env), timeout=10) as http:
        listed = http.get("/api/v0/nodes", params={"limit": 100})
    listed.raise_for_status()
    return [n for n in listed.json()["data"]["result"]["result"] if n["state"] == "ALIVE"]


def served(log: pathlib.Path) -> bool:
    """Whether a replica's log has an access line for a completion it answered with 200."""
    return log.is_file() and "/v1/completions 200 " in log.read_text(errors="replace")


def complete(http_port: int, index: int) -> tuple[int, str, str]:
    prompt = f"request {index} "
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20}
    reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=30)
    text = reply.json()["choices"][0]["text"] if reply.status_code == 200 else reply.text
    return reply.status_code, text, (prompt * 20)[:20]  # the fake model echoes the prompt


def test_replicas_spread_over_two_nodes_and_serve(two_nodes, tmp_path):
    address, env, temp_dir = two_nodes
    head_log = temp_dir / "head.log"
    http_port = free_port()
    config = tmp_path / "serve_config.yaml"
    # the ingress hosts the fake model: 2 replicas, at most one per node
    replica = {"num_cpus": 0, "num_replicas": 2, "max_replicas_per_node": 1}
    config.write_text(yaml.safe_dump(app_config(http_port, APP, replica), sort_keys=False))
    # What docs/deployment.md warns about: a CLI without the cluster's token is refused.
    bare = {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    refused = serve_cli(address, bare, "status")
    assert refused.returncode != 0 and "Authentication" in refused.stdout + refused.stderr, refused.stdout + refused.stderr
    deployed = serve_cli(address, env, "deploy", str(config))
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    # RUNNING: both replicas started, which max_replicas_per_node 1 only allows with the second node joined
    state = placement(address, env, DEPLOY_TIMEOUT_S)
    assert state["status"] == "RUNNING", f"{state}\n{head_log.read_text()[-3000:]}"
    assert app_status(address, env, APP)[0] == "RUNNING"  # what `serve status` tells a user

    running = [r for r in state["replicas"] if r["state"] == "RUNNING"]
    assert len(running) == 2 and {r["deployment"] for r in running} == {"OpenAIIngress"}, state
    assert len(state["nodes"]) == 2, state
    labels = {node: [name for name in NODE_RESOURCES if name in resources] for node, resources in state["nodes"].items()}
    assert sorted(label for r in running for label in labels[r["node_id"]]) == list(NODE_RESOURCES), (labels, running)

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        replies = list(pool.map(lambda i: complete(http_port, i), range(NUM_REQUESTS)))
    assert [status for status, _, _ in replies] == [200] * NUM_REQUESTS, replies
    assert all(text == expected for _, text, expected in replies), replies
    # both replicas served some: each one's access log (Serve writes it on the replica's node; both nodes
    # here keep their logs in the one session directory) has completions answered 200
    logs = {r["node_id"]: temp_dir / "session_latest" / "logs" / r["log"].lstrip("/") for r in running}
    deadline = time.monotonic() + 10
    while not all(served(log) for log in logs.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert {labels[node][0]: served(log) for node, log in logs.items()} == {"node_a": True, "node_b": True}, logs
    # no `serve shutdown`: the app goes with the nodes (a shutdown would first drain its replicas, seconds spent)
