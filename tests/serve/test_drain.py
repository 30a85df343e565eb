"""Streams that end before their answer, on the fake model: clients that go away under load (their requests stop
in the engine and free their KV, the others go on to their full answers), and replicas that go, a redeploy or a
delete while 16 streams run (graceful drain: none of them lost silently).

Each drained stream either completes with the full answer (the fake model's ``echo``) or ends with an explicit
error event (then ``[DONE]``); a stream that hangs, or ends without ``[DONE]`` and without an error event, fails
the test. The app is the fake model in an app of its own: one model hosted by the ingress, one behind it in an
LLMServer deployment (relayed through the ingress), so both paths are used. Its streams send a chunk every 200 ms
at most: each chunk costs the proxy and the replicas ~4 ms of CPU, and 16 streams of a chunk per 20 ms token would
keep a 2-core machine busy relaying. The tests run in this order on one app: the clients leave, then the redeploy
replaces its replicas, then the delete.
"""

import asyncio
import json
import time

import httpx
import pytest
from ray import serve
from ray.serve import Application

from tests.serve.conftest import BASE, with_deployment_options
from tests.serve.fake_model import echo

pytestmark = pytest.mark.serve

APP, PREFIX = "streams", "/streams"
LOCAL, REMOTE = "streams-local", "streams-remote"  # hosted by the ingress / an LLMServer deployment of its own
NUM_STREAMS = 16
STREAM_LIMIT_S = 60  # no stream may take longer: a hang fails the test
KEPT_TOKENS = 400  # ~400 fake steps of 20 ms: still running well after the clients that leave have left


def _args(step_timeout_s: float = 60.0) -> dict:
    def served(name: str) -> dict:
        engine = {"separate_process": False, "stream_interval_ms": 200, "step_timeout_s": step_timeout_s}
        return {"model": {"source": name}, "engine": engine, "replica": {"num_cpus": 0}}

    return {"server_factory": "tests.serve.fake_model:fake_model_server", "models": [served(LOCAL), served(REMOTE)]}


def _app(args: dict, graceful_shutdown_timeout_s: float | None = None) -> Application:
    """The app as build_app makes it; optionally every deployment with a shorter grace period than the default."""
    from deployments.builder import build_app

    app = build_app(args)
    if graceful_shutdown_timeout_s is None:
        return app
    return with_deployment_options(app, graceful_shutdown_timeout_s=graceful_shutdown_timeout_s)


def _deploy(app: Application) -> None:
    serve.run(app, name=APP, route_prefix=PREFIX)


@pytest.fixture(scope="module")
def streams_app(serve_cluster):
    _deploy(_app(_args()))
    yield
    serve.delete(APP, _blocking=False)  # (gone after the delete test) its replicas leave while the next tests run


def _model(i: int) -> str:
    return LOCAL if i % 2 == 0 else REMOTE


async def _stream(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, first: asyncio.Event) -> dict:
    """One streamed completion, read to its end: what came, and how it ended."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    text, error, done = [], None, False
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"outcome": "refused", "status": response.status_code, "body": (await response.aread()).decode()}
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                else:
                    text.append(event["choices"][0]["text"] if event["choices"] else "")
                    first.set()
    except httpx.TransportError as exc:  # the connection broke: a silent truncation
        return {"outcome": "truncated", "text": "".join(text), "why": repr(exc)}
    text = "".join(text)
    expected = echo(prompt, max_tokens)
    if done and error is None and text == expected:
        return {"outcome": "complete", "text": text}
    if done and error is not None and expected.startswith(text):
        return {"outcome": "error", "code": error["code"], "message": error["message"]}
    return {"outcome": "truncated", "text": text, "done": done, "error": error}


async def _run_streams(max_tokens: list[int], during) -> tuple[list[dict], float]:
    """Start the streams, wait until each has its first chunk, run ``during()`` (blocking, in a thread), then
    read every stream to its end; returns their outcomes and how long ``during`` took."""
    async with httpx.AsyncClient(base_url=BASE + PREFIX, timeout=STREAM_LIMIT_S) as http:
        firsts = [asyncio.Event() for _ in max_tokens]
        streams = [asyncio.ensure_future(asyncio.wait_for(_stream(http, _model(i), f"stream {i} says hello. ", n, firsts[i]),
                                                          STREAM_LIMIT_S))
                   for i, n in enumerate(max_tokens)]
        await asyncio.wait_for(asyncio.gather(*(first.wait() for first in firsts)), timeout=30)
        started = time.monotonic()
        await asyncio.to_thread(during)
        took = time.monotonic() - started
        outcomes = await asyncio.gather(*streams, return_exceptions=True)
    hung = [i for i, o in enumerate(outcomes) if isinstance(o, asyncio.TimeoutError)]
    assert not hung, f"streams {hung} hung for {STREAM_LIMIT_S} s"
    assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
    truncated = {i: o for i, o in enumerate(outcomes) if o["outcome"] not in ("complete", "error")}
    assert not truncated, f"streams ended without [DONE] and without an error event: {truncated}"
    return outcomes, took


async def _stats(model: str) -> dict:
    return await serve.get_app_handle(APP).model_stats.remote(model)


async def _wait_for(model: str, done, timeout_s: float = 10) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout_s
    stats = await _stats(model)
    while not done(stats) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
        stats = await _stats(model)
    return stats


async def test_half_of_16_streams_disconnecting_stops_their_work_and_the_rest_finish(streams_app):
    models = [LOCAL, REMOTE]
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


async def test_a_redeploy_while_16_streams_run_lets_them_finish(streams_app):
    # ~500 fake steps of 20 ms: the streams outlast the redeploy, not the default 60 s grace period
    outcomes, took = await _run_streams([500] * NUM_STREAMS, lambda: _deploy(_app(_args(step_timeout_s=30.0))))
    assert [o["outcome"] for o in outcomes] == ["complete"] * NUM_STREAMS, outcomes
    async with httpx.AsyncClient(base_url=BASE + PREFIX, timeout=30) as http:
        for model in (LOCAL, REMOTE):  # the new replicas serve
            response = await http.post("/v1/completions", json={"model": model, "prompt": "after", "max_tokens": 5})
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == echo("after", 5)
    ingress = serve.get_app_handle(APP)
    for model in (LOCAL, REMOTE):  # replaced: the streams finished on the old replicas, only this request here
        assert (await ingress.model_stats.remote(model))["num_finished"] == 1


async def test_a_delete_while_16_streams_run_finishes_short_ones_and_ends_the_rest_with_an_error_event(streams_app):
    grace_s = 5.0
    await asyncio.to_thread(_deploy, _app(_args(), graceful_shutdown_timeout_s=grace_s))
    short, endless = 75, 100_000  # ~1.5 s of fake steps / ~30 min: cut at the end of the drain window
    # by fours: short on each model, then endless on each model (_model alternates)
    lengths = [short, short, endless, endless] * (NUM_STREAMS // 4)
    outcomes, took = await _run_streams(lengths, lambda: serve.delete(APP))
    assert [o["outcome"] for o, n in zip(outcomes, lengths) if n == short] == ["complete"] * (NUM_STREAMS // 2), outcomes
    cut = [o for o, n in zip(outcomes, lengths) if n == endless]
    assert [o["outcome"] for o in cut] == ["error"] * (NUM_STREAMS // 2), outcomes
    for o in cut:
        assert o["code"] == "replica_unavailable" and "retry" in o["message"], o
    assert took < 3 * grace_s, took  # the delete (the streams end with it) within the grace periods, well before any timeout
