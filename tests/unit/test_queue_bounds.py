"""Backpressure in the engine front: a bounded wait for a place in the batch, a deadline on the first token."""

import asyncio
import time
import json

import pytest

from app.api.errors import to_api_error
from app.config import EngineConfig, ReplicaConfig, ServedModelConfig
from app.engine import AsyncEngine, EngineOverloadedError, Request, SamplingParams
from app.engine.errors import EngineQueueTimeoutError
from tests.unit.fakes import QueueingCore, in_thread, until


def _request(rid, max_tokens=3):
    return Request(rid, [1], SamplingParams(max_tokens=max_tokens))


async def _collect(engine, rid, max_tokens):
    return [t async for o in engine.generate(_request(rid, max_tokens)) for t in o.new_token_ids]


async def test_a_request_without_a_place_in_time_ends_with_a_queue_timeout_and_leaves_the_engine():
    core = QueueingCore(max_running=1)
    engine = AsyncEngine(in_thread(lambda: core), max_queue_time_s=0.2)
    running = asyncio.ensure_future(_collect(engine, "long", max_tokens=100))  # ~0.5 s alone in the batch
    await until(lambda: engine.num_running == 1)
    waiting = engine.generate(_request("late"))
    with pytest.raises(EngineQueueTimeoutError, match="engine.max_queue_time_s"):
        await waiting.__anext__()
    await until(lambda: "late" in core.aborted)
    assert "late" not in core.requests
    assert await running == list(range(100))  # the running request is untouched and complete
    engine.shutdown(1)


async def test_a_request_past_its_first_token_is_never_timed_out():
    class Slower(QueueingCore):
        def step(self):
            time.sleep(0.02)
            return super().step()

    engine = AsyncEngine(in_thread(lambda: Slower(max_running=1)), max_queue_time_s=0.5)  # a loaded machine's first token in time
    assert await _collect(engine, "slow", max_tokens=80) == list(range(80))  # ~2 s, four deadlines long
    engine.shutdown(1)


async def test_a_replica_holds_its_batch_and_its_queue_and_refuses_one_more():
    from app.server import _front_options

    config = ServedModelConfig(engine=EngineConfig(max_num_seqs=2, max_queued_requests=2, max_batch_size=2))
    options = _front_options(config)
    assert options["max_queued_requests"] == 4  # 2 running + 2 waiting for a place
    engine = AsyncEngine(in_thread(lambda: QueueingCore(max_running=2)), max_queued_requests=options["max_queued_requests"])
    admitted = [asyncio.ensure_future(_collect(engine, f"r{i}", max_tokens=40)) for i in range(4)]  # a burst: all at once
    await until(lambda: engine.num_unfinished == 4)
    with pytest.raises(EngineOverloadedError, match="engine.max_queued_requests"):
        await engine.generate(_request("one-too-many")).__anext__()
    assert [len(tokens) for tokens in await asyncio.gather(*admitted)] == [40] * 4  # every admitted one completes
    engine.shutdown(1)


async def test_both_are_503_with_retry_after_telling_when_to_come_back():
    from deployments.http_answers import RETRY_AFTER_S, guarded

    async def timed_out():
        raise EngineQueueTimeoutError("no place for this request on the replica within 2 s (engine.max_queue_time_s); retry later")

    response = await guarded(timed_out(), "req-9")
    assert response.status_code == 503 and response.headers["retry-after"] == str(RETRY_AFTER_S)
    error = json.loads(response.body)["error"]
    assert error["code"] == "queue_timeout" and error["message"].startswith("no place for this request")
    assert to_api_error(EngineOverloadedError("full")).code == "overloaded"


def test_config_bounds_and_the_serve_limit_that_leaves_the_engine_room():
    served = ServedModelConfig()
    engine = served.engine
    assert engine.max_queued_requests == 64 and engine.max_queue_time_s == 0
    # Serve hands a replica its batch, its queue and one admission window: past that the engine answers
    assert served.replica.max_ongoing_requests == engine.max_num_seqs + engine.max_queued_requests + engine.max_batch_size
    assert ServedModelConfig(replica=ReplicaConfig(max_ongoing_requests=48)).replica.max_ongoing_requests == 48
    with pytest.raises(ValueError, match="engine.max_queue_time_s"):
        EngineConfig(max_queue_time_s=-1)


async def test_a_request_of_several_generations_is_admitted_whole_or_refused_whole():
    """n choices on a replica with room for fewer: one 503, counted once; none of its choices reaches the engine
    (they would run, then be aborted with it)."""
    from app.api.protocol import CompletionRequest, parse_body
    from app.api.serving import OpenAIServing
    from tests.serve.fake_model import ByteTokenizer

    core = QueueingCore(max_running=2)
    engine = AsyncEngine(in_thread(lambda: core), max_queued_requests=4)
    serving = OpenAIServing(engine, ByteTokenizer(), "m", 100, [0], 256)
    admitted = [asyncio.ensure_future(_collect(engine, f"r{i}", max_tokens=40)) for i in range(2)]
    await until(lambda: engine.num_unfinished == 2)
    request = parse_body({"model": "m", "prompt": "hi", "n": 3, "max_tokens": 5}, CompletionRequest)
    with pytest.raises(EngineOverloadedError, match="3 generations"):
        await serving.completion(request)
    with pytest.raises(EngineOverloadedError, match="3 generations"):  # a stream too, before its first byte
        await anext(serving.completion_stream(request))
    assert set(core.requests) | set(core.aborted) == {"r0", "r1"}  # none of the three reached the engine
    metrics = serving.metrics_for("m").to_dict()
    assert metrics["request_rejected"]["overloaded"] == 2 and sum(metrics["request_success"].values()) == 0
    fits = parse_body({"model": "m", "prompt": "hi", "n": 2, "max_tokens": 5}, CompletionRequest)
    assert len((await serving.completion(fits))["choices"]) == 2  # two fit: served
    assert [len(tokens) for tokens in await asyncio.gather(*admitted)] == [40] * 2
    engine.shutdown(1)


async def test_two_multi_choice_requests_at_once_are_each_admitted_or_refused_whole(monkeypatch):
    """Four free places, two requests of three choices in the same moment: one is served whole, the other refused
    whole; no choice of the refused one reaches the engine (the places of the first are held as its choices start)."""
    from app.api.protocol import CompletionRequest, parse_body
    from app.api.serving import OpenAIServing
    from tests.serve.fake_model import ByteTokenizer

    async def at_once(call, *args):  # both tokenized in one turn of the loop, then each checked before either starts
        await asyncio.sleep(0)
        return call(*args)

    monkeypatch.setattr(asyncio, "to_thread", at_once)
    core = QueueingCore(max_running=4)
    engine = AsyncEngine(in_thread(lambda: core), max_queued_requests=4)
    serving = OpenAIServing(engine, ByteTokenizer(), "m", 100, [0], 256)
    body = {"model": "m", "prompt": "hi", "n": 3, "max_tokens": 5}
    results = await asyncio.gather(*(serving.completion(parse_body(body, CompletionRequest)) for _ in range(2)),
                                   return_exceptions=True)
    assert sorted(type(r).__name__ for r in results) == ["EngineOverloadedError", "dict"]
    assert not core.aborted and len(next(r for r in results if isinstance(r, dict))["choices"]) == 3
    assert serving.metrics_for("m").to_dict()["request_rejected"]["overloaded"] == 1
    _, again = await asyncio.gather(asyncio.sleep(0), serving.completion(parse_body(body, CompletionRequest)))
    assert len(again["choices"]) == 3  # every place given back
    engine.shutdown(1)
