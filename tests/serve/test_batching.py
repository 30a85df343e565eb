"""Batching through the whole stack: concurrent HTTP requests share engine steps, and leaving early frees the engine."""

import asyncio
import time

import httpx
import pytest
from ray import serve

from tests.serve.conftest import BASE, MODEL

pytestmark = pytest.mark.serve

PROMPTS = ["The capital of France is", "def add(a, b):", "Rain falls because", "1, 1, 2, 3, 5,", "Dear friend,", "Cats are"]


def _engine_stats() -> dict:
    return serve.get_app_handle("default").model_stats.remote(MODEL).result()


def _wait_until_idle(timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _engine_stats()
        if (stats["num_requests"] == 0 and stats["kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def _body(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 10, "min_tokens": 10, "temperature": 0}


async def _complete_all(bodies: list[dict]) -> list[str]:
    async with httpx.AsyncClient(base_url=BASE, timeout=120) as http:
        responses = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json()["choices"][0]["text"] for r in responses]


def test_concurrent_requests_share_steps_and_match_their_lone_answers(serve_app):
    bodies = [_body(p) for p in PROMPTS]
    alone = [asyncio.run(_complete_all([b]))[0] for b in bodies]
    steps_before = _engine_stats()["num_steps"]
    together = asyncio.run(_complete_all(bodies))
    steps = _engine_stats()["num_steps"] - steps_before
    assert together == alone
    # One request at a time would take 10 steps each; sharing steps takes far fewer in total.
    assert steps < 10 * len(bodies) / 2


def test_http_disconnect_aborts_the_request_in_the_engine(serve_app):
    body = {**_body("Count from one to a thousand:"), "max_tokens": 4000, "min_tokens": 4000, "stream": True}
    with httpx.Client(base_url=BASE, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()  # keep it: a dropped line iterator closes the connection
            first = next(lines)
            assert response.status_code == 200 and first.startswith("data:"), first
            assert _engine_stats()["num_requests"] == 1
    # 4000 tokens would take minutes; the disconnect must stop it and free its KV blocks at once.
    stats = _wait_until_idle()
    assert stats["num_requests"] == 0 and stats["kv_blocks_used"] == 0


def test_handle_cancel_aborts_the_request_in_the_engine(serve_app):
    ingress = serve.get_app_handle("default")
    body = {**_body("Write a very long story:"), "max_tokens": 4000, "min_tokens": 4000}
    stream = ingress.options(stream=True).completions_stream.remote(body)
    first = next(iter(stream))
    assert first["choices"][0]["text"] is not None
    stream.cancel()
    stats = _wait_until_idle()
    assert stats["num_requests"] == 0 and stats["kv_blocks_used"] == 0
