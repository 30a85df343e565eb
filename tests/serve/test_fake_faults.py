"""Clients that go away under load, on the fake model: their requests stop in the engine and free their KV,
the others go on to their full answers.

An app of its own, whose streams send a chunk every 200 ms at most: each chunk costs the proxy and the
replicas ~4 ms of CPU, and 16 streams of a chunk per 20 ms token would keep a 2-core machine busy relaying.
"""

import asyncio
import json

import httpx
import pytest
from ray import serve

from tests.serve.conftest import BASE
from tests.serve.fake_model import echo

pytestmark = pytest.mark.serve

APP, PREFIX = "faults", "/faults"
MODELS = ["faults-local", "faults-remote"]  # the one the ingress hosts, and one behind it (relayed through a handle)
NUM_STREAMS = 16
KEPT_TOKENS = 400  # ~400 fake steps of 20 ms: still running well after the others left


@pytest.fixture(scope="module")
def faults_app(serve_cluster):
    from deployments.builder import build_app

    def served(name: str) -> dict:
        engine = {"separate_process": False, "stream_interval_ms": 200}
        return {"model": {"source": name}, "engine": engine, "replica": {"num_cpus": 0}}

    args = {"server_factory": "tests.serve.fake_model:fake_model_server", "models": [served(name) for name in MODELS]}
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield
    serve.delete(APP, _blocking=False)  # its replicas leave while the next tests run


async def _stats(model: str) -> dict:
    return await serve.get_app_handle(APP).model_stats.remote(model)


async def _wait_for(model: str, done, timeout_s: float = 10) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout_s
    stats = await _stats(model)
    while not done(stats) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
        stats = await _stats(model)
    return stats


async def test_half_of_16_streams_disconnecting_stops_their_work_and_the_rest_finish(faults_app):
    models = MODELS
    before = {model: await _stats(model) for model in models}
    assert all(stats["num_running"] == 0 for stats in before.values()), before
    started = [asyncio.Event() for _ in range(NUM_STREAMS)]
    leave = asyncio.Event()

    async def stream(i: int, http: httpx.AsyncClient) -> str | None:
        """Even streams leave after their first chunk; odd ones read to the end and return the text."""
        body = {"model": models[(i // 2) % 2], "prompt": f"client {i} ", "max_tokens": KEPT_TOKENS if i % 2 else 100_000,
                "stream": True}
        text = []
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                started[i].set()
                text.append(json.loads(line[len("data: "):])["choices"][0]["text"])
                if i % 2 == 0 and leave.is_set():
                    return None  # leaving the block closes the connection mid-stream
        return "".join(text)

    async with httpx.AsyncClient(base_url=BASE + PREFIX, timeout=60) as http:
        tasks = [asyncio.ensure_future(stream(i, http)) for i in range(NUM_STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=30)
        loaded = {model: await _stats(model) for model in models}
        assert all(stats["num_running"] == NUM_STREAMS // 2 for stats in loaded.values()), loaded
        leave.set()
        # the leavers' requests end in the engine (aborted, KV freed) while the kept ones still run
        for model in models:
            stats = await _wait_for(model, lambda s: s["num_running"] == NUM_STREAMS // 4)
            assert stats["num_running"] == NUM_STREAMS // 4, stats
            assert stats["num_aborted"] == before[model]["num_aborted"] + NUM_STREAMS // 4, stats
        texts = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    for i, text in enumerate(texts):
        assert text == (echo(f"client {i} ", KEPT_TOKENS) if i % 2 else None), i
    for model in models:  # all done: nothing left running, every stream's blocks back in the pool
        stats = await _wait_for(model, lambda s: s["num_running"] == 0 and s["num_requests"] == 0)
        assert stats["num_running"] == 0 and stats["num_requests"] == 0, stats
        assert stats["num_finished"] == before[model]["num_finished"] + NUM_STREAMS // 4, stats
