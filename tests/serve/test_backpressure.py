"""Backpressure over HTTP: a replica holds its batch and a bounded queue; one more request gets 503 with
Retry-After at once, a request with no place in time ends with 503 (or an error event, once its stream has
started), and every admitted request completes with its whole answer.

Its own app on the fake model (tests/serve/fake_model.py), with tiny bounds: ``bounded`` (hosted by the
ingress) runs 2 requests and lets 2 wait; ``deadline`` (an LLMServer deployment, so errors also cross a
handle) runs 1 at a time and gives a waiting request 0.5 s.
"""

import json
import threading
import time

import httpx
import pytest
from ray import serve

from deployments.builder import build_app
from tests.serve.conftest import BASE
from tests.serve.fake_model import echo

pytestmark = pytest.mark.serve

APP = "backpressure"
BOUNDED, DEADLINE = "bounded", "deadline"
LONG = 100  # tokens: 2 s of the fake's 20 ms steps, far longer than the burst takes to arrive


def _served(name: str, **engine) -> dict:
    return {"model": {"source": name}, "engine": {"separate_process": False, "max_batch_size": 2, **engine},
            "replica": {"num_cpus": 0}}


@pytest.fixture(scope="module")
def client(serve_cluster):
    models = [_served(BOUNDED, max_num_seqs=2, max_queued_requests=2),
              _served(DEADLINE, max_num_seqs=1, max_queued_requests=4, max_queue_time_s=0.5)]
    serve.run(build_app({"server_factory": "tests.serve.fake_model:fake_model_server", "models": models}),
              name=APP, route_prefix=f"/{APP}")
    try:
        with httpx.Client(base_url=f"{BASE}/{APP}", timeout=60) as http:
            yield http
    finally:
        serve.delete(APP, _blocking=False)  # its replicas leave while the next tests run


def _stream(client: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, list]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        lines = list(response.iter_lines())
    if response.status_code != 200:
        return response, [json.loads("".join(lines))]
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return response, [json.loads(event) for event in events[:-1]]


def _text(events: list) -> str:
    return "".join(choice.get("text") or choice.get("delta", {}).get("content") or ""
                   for event in events for choice in event.get("choices", []))


def test_past_the_batch_and_queue_clients_get_503_with_retry_after_and_the_admitted_complete(client):
    results = [None] * 10
    prompts = [f"burst {i} " for i in range(10)]

    def send(i):  # streamed completions, and two streamed chats (8, 9): refused before their first byte too
        if i < 8:
            results[i] = _stream(client, "/v1/completions", {"model": BOUNDED, "prompt": prompts[i], "max_tokens": LONG})
        else:
            chat = {"model": BOUNDED, "messages": [{"role": "user", "content": prompts[i]}], "max_tokens": LONG}
            results[i] = _stream(client, "/v1/chat/completions", chat)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    admitted = [i for i, (response, _) in enumerate(results) if response.status_code == 200]
    refused = [i for i, (response, _) in enumerate(results) if response.status_code != 200]
    assert len(admitted) == 4, [response.status_code for response, _ in results]  # 2 running + 2 waiting
    for i in admitted:
        events = results[i][1]
        assert "error" not in events[-1]
        if i < 8:
            assert _text(events) == echo(prompts[i], LONG)
        else:
            assert events[0]["choices"][0]["delta"]["role"] == "assistant" and len(_text(events)) > 0
    for i in refused:
        response, [body] = results[i]
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert body["error"]["code"] == "overloaded" and "engine.max_queued_requests" in body["error"]["message"]
    after = client.post("/v1/completions", json={"model": BOUNDED, "prompt": "again", "max_tokens": 5})
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == echo("again", 5)


def test_a_request_with_no_place_in_time_ends_with_a_clear_error_and_the_running_one_completes(client):
    running = {}

    def long_request():
        running["result"] = _stream(client, "/v1/completions", {"model": DEADLINE, "prompt": "first ", "max_tokens": LONG})

    thread = threading.Thread(target=long_request)
    thread.start()
    try:
        # wait until the long request holds the engine's only place
        deadline = time.monotonic() + 30
        while serve.get_app_handle(APP).model_stats.remote(DEADLINE).result()["num_running"] != 1:
            assert time.monotonic() < deadline, "the long request never reached the engine's batch"
            threading.Event().wait(0.02)
        # no token yet: the HTTP status says it
        response, [body] = _stream(client, "/v1/completions", {"model": DEADLINE, "prompt": "late", "max_tokens": 5})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert body["error"]["code"] == "queue_timeout" and "engine.max_queue_time_s" in body["error"]["message"]
        # a chat stream too: its role chunk waits for admission, so the status still says it
        chat = {"model": DEADLINE, "messages": [{"role": "user", "content": "late"}], "max_tokens": 5}
        response, [body] = _stream(client, "/v1/chat/completions", chat)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert body["error"]["code"] == "queue_timeout"
    finally:
        thread.join()
    response, events = running["result"]
    assert response.status_code == 200 and _text(events) == echo("first ", LONG)
