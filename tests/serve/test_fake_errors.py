"""Failures on the server's side, as clients see them: plain words and a request id, never internals.

The fake model (tests/serve/fake_model.py) fails on request: its tokenizer raises RuntimeError(SECRET),
its engine fails a request with that exception's text after two tokens, or its replica's process exits.
"""

import json
import threading
import time

import httpx
import pytest
from ray import serve

from app.api.errors import APIError
from tests.serve.conftest import FAKE_APP, FRAGILE_MODEL
from tests.serve.fake_model import SECRET

pytestmark = pytest.mark.serve

INTERNALS = [SECRET, "RuntimeError", "RequestFailedError", "ActorDiedError", "RayActorError", "Traceback"]


def _assert_plain_with_request_id(error: dict, request_id: str) -> None:
    """The error names the request, so the server log can be searched, and shows nothing of the exception."""
    assert request_id and f"(request id {request_id})" in error["message"], error
    assert not [word for word in INTERNALS if word in json.dumps(error)], error


def _sse_events(response: httpx.Response) -> list:
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def _chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 5}


@pytest.mark.parametrize("path, body, good", [
    ("/v1/completions", {"prompt": "crash-tokenizer", "max_tokens": 5}, {"prompt": "fine", "max_tokens": 5}),
    ("/v1/completions", {"prompt": "crash-tokenizer", "stream": True}, {"prompt": "fine", "stream": True}),
    ("/v1/chat/completions", {**_chat("crash-tokenizer"), "stream": True}, {**_chat("fine"), "stream": True}),
    ("/v1/generate", {"prompt": "crash-tokenizer"}, {"prompt": "fine"}),
], ids=["completion", "completion streamed", "chat streamed", "generate"])
def test_an_unexpected_exception_is_a_plain_500_naming_the_request(fake_client, path, body, good):
    response = fake_client.post(path, json=body)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "internal_server_error" and error["code"] == "internal_error"
    _assert_plain_with_request_id(error, response.headers["x-request-id"])
    assert fake_client.post(path, json=good).status_code == 200


def test_a_failure_mid_stream_is_an_error_event_naming_the_request(fake_client):
    body = {"messages": [{"role": "user", "content": "fail-after-2"}], "max_tokens": 50, "stream": True}
    response = fake_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200  # the role chunk went out before the engine failed
    events = _sse_events(response)
    assert "choices" in events[0] and "error" in events[-1]
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert "us".startswith(streamed)  # the echo of "user: ...", up to the failure
    assert events[-1]["error"]["code"] == "generation_failed"
    _assert_plain_with_request_id(events[-1]["error"], response.headers["x-request-id"])


def test_a_failure_without_stream_is_a_plain_500(fake_client):
    response = fake_client.post("/v1/completions", json={"prompt": "fail-after-2", "max_tokens": 50})
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "generation_failed"
    _assert_plain_with_request_id(response.json()["error"], response.headers["x-request-id"])


@pytest.mark.parametrize("method", ["completions", "completions_stream"])
def test_a_handle_caller_gets_a_plain_api_error(fake_app, method):
    ingress = serve.get_app_handle(FAKE_APP)
    body = {"prompt": "crash-tokenizer", "max_tokens": 5}
    with pytest.raises(APIError) as info:
        if method.endswith("_stream"):
            list(ingress.options(stream=True).completions_stream.remote(body))
        else:
            ingress.completions.remote(body).result()
    assert info.value.status == 500 and "(request id " in info.value.message
    assert SECRET not in str(info.value) and SECRET not in info.value.message


def test_a_killed_replica_is_a_503_telling_to_retry(fake_client):
    long_chat = {"model": FRAGILE_MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 100_000}
    arrivals = []  # (when, event) of the stream that runs while the replica is killed

    def read(lines) -> None:
        for line in lines:
            if line.startswith("data: "):
                arrivals.append((time.monotonic(), line[len("data: "):]))

    with fake_client.stream("POST", "/v1/chat/completions", json={**long_chat, "stream": True}) as streaming:
        lines = streaming.iter_lines()
        assert streaming.status_code == 200 and next(lines).startswith("data:")
        reader = threading.Thread(target=read, args=(lines,))
        reader.start()
        killed_at = time.monotonic()  # the killer's replica exits two fake steps (~40 ms) after it arrives
        killer = fake_client.post("/v1/completions", json={"model": FRAGILE_MODEL, "prompt": "kill-replica-after-2", "max_tokens": 9})
        reader.join(timeout=30)
    assert not reader.is_alive(), "the stream did not end after its replica died"
    rest = [event for _, event in arrivals]
    assert killer.status_code == 503, killer.text
    assert killer.json()["error"]["message"].startswith("the model replica stopped while serving this request; retry")
    _assert_plain_with_request_id(killer.json()["error"], killer.headers["x-request-id"])
    assert rest[-1] == "[DONE]"
    in_stream = json.loads(rest[-2])["error"]
    assert in_stream["code"] == "replica_unavailable"
    _assert_plain_with_request_id(in_stream, streaming.headers["x-request-id"])
    error_after_s = arrivals[-2][0] - killed_at
    # seconds, not the reader's 30 s limit (routing the killer and Ray noticing the death, on a loaded CI machine)
    assert error_after_s < 10, f"the error event came {error_after_s:.1f} s after the kill"
    served_after_s = _wait_until_served_again(fake_client, FRAGILE_MODEL) - killed_at
    assert served_after_s < 60, f"the replacement replica served {served_after_s:.1f} s after the kill"
    print(f"killed replica: error event after {error_after_s:.2f} s, served again after {served_after_s:.1f} s")


def _wait_until_served_again(client: httpx.Client, model: str, timeout_s: float = 90) -> float:
    """Serve replaces the dead replica; later tests (and /health) need it back. Returns when it first answered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.post("/v1/completions", json={"model": model, "prompt": "back?", "max_tokens": 2}).status_code == 200:
            return time.monotonic()
        time.sleep(0.5)
    raise AssertionError(f"{model} was not served again within {timeout_s} s")


def test_the_log_has_the_exception_and_traceback_under_the_request_id(caplog):
    from deployments.http_answers import reported

    try:
        raise RuntimeError(SECRET)
    except RuntimeError as exc:
        error = reported(exc, "req-42")
    assert error.status == 500 and SECRET not in error.message
    [record] = [r for r in caplog.records if r.name == "deployments.http_answers"]
    assert "req-42" in record.getMessage()
    assert record.exc_info[1].args == (SECRET,)  # the traceback is printed from it


async def test_a_full_queue_answers_503_with_retry_after_and_a_client_error_without():
    from app.engine import EngineOverloadedError
    from deployments.http_answers import RETRY_AFTER_S, guarded

    async def overloaded():
        raise EngineOverloadedError("the replica already holds 8 requests (engine.max_queued_requests); retry later")

    async def bad():
        raise APIError(400, "max_tokens must be at least 1", param="max_tokens")

    busy = await guarded(overloaded(), "req-7")
    assert busy.status_code == 503 and busy.headers["retry-after"] == str(RETRY_AFTER_S)
    assert json.loads(busy.body)["error"]["code"] == "overloaded"
    refused = await guarded(bad(), "req-8")
    assert refused.status_code == 400 and "retry-after" not in refused.headers
