"""The serving layer on a real Serve cluster and real HTTP, with a fake model injected (tests/serve/fake_model.py).

Everything but the model is the product's code: ingress, replica, @serve.batch window, AsyncEngine,
OpenAIServing. The fake answers each prompt with itself (``echo``), so every answer is known.
"""

import asyncio
import json
import time

import httpx
import pytest
from ray import serve

from app.api.errors import APIError
from tests.serve.conftest import FAKE_APP, FAKE_BASE, FAKE_MODELS, FAKE_TWIN, FRAGILE_MODEL
from tests.serve.fake_model import echo

pytestmark = pytest.mark.serve

MODEL_A, MODEL_B = FAKE_MODELS
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
CHAT_PROMPT = "user: hi\nassistant:"  # what the fake chat template makes of CHAT


def _stats(model: str) -> dict:
    return serve.get_app_handle(FAKE_APP).model_stats.remote(model).result()


def _wait_for_stats(model: str, done, timeout_s: float = 10) -> dict:
    deadline = time.monotonic() + timeout_s
    stats = _stats(model)
    while not done(stats) and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = _stats(model)
    return stats


def _sse(response: httpx.Response) -> list[dict]:
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def _streamed_text(chunks: list[dict]) -> str:
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    return "".join(choice.get("text", choice.get("delta", {}).get("content", "")) or "" for choice in choices)


def test_each_model_name_reaches_its_own_replica(fake_client):
    before = {model: _stats(model)["num_finished"] for model in FAKE_MODELS}
    response = fake_client.post("/v1/completions", json={"model": MODEL_B, "prompt": "route me", "max_tokens": 11})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == MODEL_B
    assert body["choices"][0]["text"] == echo("route me", 11)
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 11, "total_tokens": 19}
    after = {model: _stats(model)["num_finished"] for model in FAKE_MODELS}
    assert after == {MODEL_A: before[MODEL_A], MODEL_B: before[MODEL_B] + 1}


def test_without_a_model_the_first_one_answers(fake_client):
    response = fake_client.post("/v1/completions", json={"prompt": "anyone", "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL_A


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL_B, "prompt": "stream me", "max_tokens": 20}),
    ("/v1/chat/completions", {**CHAT, "model": MODEL_B, "max_tokens": 30}),
])
def test_streamed_answer_equals_non_streamed(fake_client, path, body):
    whole = fake_client.post(path, json=body).json()
    streamed = fake_client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200
    chunks = _sse(streamed)
    choice = whole["choices"][0]
    expected = echo(body.get("prompt", CHAT_PROMPT), body["max_tokens"])
    assert choice.get("text", choice.get("message", {}).get("content")) == expected
    assert _streamed_text(chunks) == expected
    assert len([c for c in chunks if c["choices"] and _streamed_text([c])]) >= 2  # in parts, not all at the end
    assert chunks[-1]["usage"] == whole["usage"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_generate_alias_streamed_and_not(fake_client):
    whole = fake_client.post("/v1/generate", json={"prompt": "gen", "max_new_tokens": 7, "model": MODEL_A})
    assert whole.status_code == 200 and whole.json()["text"] == echo("gen", 7)
    streamed = fake_client.post("/v1/generate", json={"prompt": "gen", "max_new_tokens": 7, "stream": True})
    assert "".join(c["text"] for c in _sse(streamed)) == echo("gen", 7)


BAD = [
    ("malformed json", "/v1/completions", b"{not json", 400, "invalid_json"),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model_not_found"),
    ("wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "invalid_type"),
    ("a string for a boolean", "/v1/completions", {"prompt": "x", "stream": "true"}, 400, "invalid_type"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "invalid_value"),
    ("unknown field", "/v1/chat/completions", {**CHAT, "frobnicate": True}, 400, "unknown_parameter"),
    ("beyond the context", "/v1/completions", {"prompt": "x", "max_tokens": 10**7}, 400, "context_length_exceeded"),
    ("beyond the context, streamed", "/v1/completions", {"prompt": "x", "max_tokens": 10**7, "stream": True}, 400,
     "context_length_exceeded"),
]


@pytest.mark.parametrize("name, path, body, status, code", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_its_status_and_the_next_request_is_served(fake_client, name, path, body, status, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = fake_client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    good = fake_client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 4})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == "fine"


def test_models_and_health(fake_client):
    models = fake_client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [FAKE_MODELS[0], FAKE_TWIN, FAKE_MODELS[1], FRAGILE_MODEL]
    assert fake_client.get(f"/v1/models/{FAKE_TWIN}").json() == models["data"][1]  # the openai client's models.retrieve
    for path, status in ((f"/v1/models/{FAKE_MODELS[0]}-nope", 404), ("/v2/completions", 404), ("/v1/models", 405)):
        response = fake_client.post(path, json={}) if status == 405 else fake_client.get(path)
        assert response.status_code == status and response.json()["error"]["message"], (path, response.text)
    health = fake_client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert set(health.json()["models"]) == set(FAKE_MODELS + [FAKE_TWIN, FRAGILE_MODEL])


def test_concurrent_requests_to_both_models_each_get_their_own_answer(fake_app):
    bodies = [{"model": FAKE_MODELS[i % 2], "prompt": f"request {i}", "max_tokens": 12 + i} for i in range(8)]

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=FAKE_BASE, timeout=30) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for body in bodies))

    responses = asyncio.run(send_all())
    answers = [(r.json()["model"], r.json()["choices"][0]["text"]) for r in responses]
    assert answers == [(b["model"], echo(b["prompt"], b["max_tokens"])) for b in bodies]


def test_http_disconnect_aborts_the_request_in_the_engine(fake_client):
    aborted = _stats(MODEL_A)["num_aborted"]
    body = {"model": MODEL_A, "prompt": "endless", "max_tokens": 100_000, "stream": True}  # ~30 min of fake steps
    with fake_client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()  # keep it: a dropped line iterator closes the connection
        assert response.status_code == 200 and next(lines).startswith("data:")
        assert _stats(MODEL_A)["num_running"] == 1
    stats = _wait_for_stats(MODEL_A, lambda s: s["num_running"] == 0)
    assert stats["num_running"] == 0 and stats["num_requests"] == 0
    assert stats["num_aborted"] == aborted + 1


def test_handle_calls_answer_as_http_does(fake_app):
    ingress = serve.get_app_handle(FAKE_APP)
    body = {"model": MODEL_B, "prompt": "handle", "max_tokens": 9}
    assert ingress.completions.remote(body).result()["choices"][0]["text"] == echo("handle", 9)
    chunks = list(ingress.options(stream=True).completions_stream.remote(body))
    assert _streamed_text(chunks) == echo("handle", 9)
    chat = ingress.chat.remote({**CHAT, "max_tokens": 5}).result()
    assert chat["choices"][0]["message"]["content"] == echo(CHAT_PROMPT, 5)
    chat_chunks = list(ingress.options(stream=True).chat_stream.remote({**CHAT, "max_tokens": 5}))
    assert _streamed_text(chat_chunks) == echo(CHAT_PROMPT, 5)
    generated = ingress.generate.remote({"prompt": "gen", "max_new_tokens": 4}).result()
    assert generated["text"] == echo("gen", 4) and generated["finish_reason"] == "length"
    pieces = list(ingress.options(stream=True).generate_stream.remote({"prompt": "gen", "max_new_tokens": 4}))
    assert "".join(p["text"] for p in pieces) == echo("gen", 4)


def test_handle_call_errors_arrive_as_api_errors(fake_app):
    ingress = serve.get_app_handle(FAKE_APP)
    with pytest.raises(APIError) as info:
        ingress.completions.remote({"model": "gpt-9", "prompt": "x"}).result()
    assert info.value.status == 404 and info.value.code == "model_not_found"


def test_handle_cancel_aborts_the_request_in_the_engine(fake_app):
    aborted = _stats(MODEL_B)["num_aborted"]
    ingress = serve.get_app_handle(FAKE_APP)
    body = {"model": MODEL_B, "prompt": "a long story", "max_tokens": 100_000}
    stream = ingress.options(stream=True).completions_stream.remote(body)
    first = next(iter(stream))["choices"][0]["text"]
    assert first and echo("a long story", 100).startswith(first)
    stream.cancel()
    stats = _wait_for_stats(MODEL_B, lambda s: s["num_aborted"] > aborted)
    assert stats["num_aborted"] == aborted + 1 and stats["num_running"] == 0
