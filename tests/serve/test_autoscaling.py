"""Autoscaling on the engines' queue depth, end to end: sustained streaming load takes a model from one
replica to two, a trickle brings it back to one, and no request fails or comes back short on the way.

Its own app on the fake model (tests/serve/fake_model.py): ``scale-a`` hosted by the ingress (which then
scales as that model) and ``scale-b`` in an LLMServer deployment, both ``num_replicas: auto`` between 1 and
2 with short delays and a target of 2 sequences per replica, so that the test's 6 streams per model need 2.
"""

import json
import threading
import time

import httpx
import pytest
from ray import serve

from deployments.builder import build_app, deployment_name
from tests.serve.conftest import BASE
from tests.serve.fake_model import echo

pytestmark = pytest.mark.serve

APP = "scaling"
HOSTED, SEPARATE = "scale-a", "scale-b"
DEPLOYMENTS = {HOSTED: "OpenAIIngress", SEPARATE: deployment_name(SEPARATE)}
STREAMS = 6  # per model under load: 3 sequences per replica even at two replicas, above the target of 2
AUTOSCALING = {
    "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 3,
    # replicas report every 0.5 s, averaged over 2 s (Serve's defaults, 10 s and 30 s, are for production)
    "metrics_interval_s": 0.5, "look_back_period_s": 2,
    # the fallback on Serve's ongoing requests (16 per replica by default) would never ask for a second
    # replica at 6 streams: scaling up here is the queue-depth metric's doing
}


def _served(name: str) -> dict:
    return {
        "model": {"source": name},
        "engine": {"separate_process": False, "stream_interval_ms": 250},  # fewer chunks: the proxy shares 2 cores
        "replica": {"num_cpus": 0, "num_replicas": "auto", "target_queue_depth": 2, "autoscaling_config": AUTOSCALING},
    }


def _running_replicas() -> dict[str, int]:
    deployments = serve.status().applications[APP].deployments
    return {model: deployments[name].replica_states.get("RUNNING", 0) for model, name in DEPLOYMENTS.items()}


def _wait_for(replicas: int, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if set(_running_replicas().values()) == {replicas}:
            return time.monotonic() - started
        time.sleep(0.25)
    raise AssertionError(f"not {replicas} replica(s) of each model within {timeout_s} s: {_running_replicas()}")


def _until_both_report_a_queue(timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        reported = [serve.get_app_handle(APP).record_autoscaling_stats.remote().result(),
                    serve.get_deployment_handle(DEPLOYMENTS[SEPARATE], APP).record_autoscaling_stats.remote().result()]
        if all(report["engine_queue_depth"] > 0 for report in reported):
            return
        assert time.monotonic() < deadline, f"no queue depth reported under load: {reported}"
        time.sleep(0.1)


class Load:
    """Client threads, each sending streamed completions one after another and checking every answer whole."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.completed = 0
        self.failures: list[str] = []

    def start(self, model: str, streams: int, max_tokens: int) -> threading.Event:
        stop = threading.Event()
        for i in range(streams):
            thread = threading.Thread(target=self._run, args=(model, f"{model} stream {i} ", max_tokens, stop), daemon=True)
            thread.start()
            self.threads.append(thread)
        return stop

    def _run(self, model: str, prompt: str, max_tokens: int, stop: threading.Event) -> None:
        while not stop.is_set() and not self.stop.is_set():
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
            try:
                with self.client.stream("POST", "/v1/completions", json=body) as response:
                    lines = list(response.iter_lines())
            except httpx.HTTPError as exc:
                self.failures.append(f"{model}: {type(exc).__name__}: {exc}")
                continue
            events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
            chunks = [json.loads(event) for event in events[:-1]] if events and events[-1] == "[DONE]" else []
            text = "".join(choice["text"] for chunk in chunks for choice in chunk.get("choices", []))
            if response.status_code != 200 or text != echo(prompt, max_tokens):
                self.failures.append(f"{model}: {response.status_code} {lines[-3:]}")
            else:
                self.completed += 1

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


@pytest.fixture(scope="module")
def client(serve_cluster):
    args = {"server_factory": "tests.serve.fake_model:fake_model_server", "models": [_served(HOSTED), _served(SEPARATE)]}
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    try:
        with httpx.Client(base_url=f"{BASE}/{APP}", timeout=60) as http:
            yield http
    finally:
        serve.delete(APP, _blocking=False)  # its replicas leave while the next tests run


def test_queue_depth_scales_each_model_up_under_load_and_back_down_without_failing_a_request(client):
    assert _running_replicas() == {HOSTED: 1, SEPARATE: 1}
    load = Load(client)
    try:
        heavy = [load.start(model, STREAMS, max_tokens=75) for model in DEPLOYMENTS]  # 1.5 s answers, back to back
        _until_both_report_a_queue()  # what Serve reads
        up_s = _wait_for(2, timeout_s=40)
        for stop in heavy:
            stop.set()
        for model in DEPLOYMENTS:  # a trickle, below the target: one replica is enough, and it keeps being served
            load.start(model, 1, max_tokens=10)
        down_s = _wait_for(1, timeout_s=40)
    finally:
        load.join()  # each client finishes the request it has in flight, those on the replica that left too
    print(f"1 -> 2 replicas in {up_s:.1f} s under load, 2 -> 1 in {down_s:.1f} s; {load.completed} answers")
    assert not load.failures, load.failures[:5]
    assert load.completed >= 2 * STREAMS
