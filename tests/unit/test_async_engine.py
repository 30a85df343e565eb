"""AsyncEngine with a small fake core: streaming, abort on early exit, overload, failures."""

import asyncio

import pytest

from app.engine import AsyncEngine, EngineOverloadedError, Request, RequestFailedError, SamplingParams
from tests.unit.fakes import CountingCore


def _request(rid, max_tokens=3):
    return Request(rid, [1], SamplingParams(max_tokens=max_tokens))


async def test_streams_until_finished():
    engine = AsyncEngine(CountingCore)
    outputs = [o async for o in engine.generate(_request("a"))]
    # Outputs that queue up while the consumer is busy arrive merged into one delta.
    assert [t for o in outputs for t in o.new_token_ids] == [0, 1, 2]
    assert outputs[-1].num_output_tokens == 3 and outputs[-1].finished
    engine.shutdown(1)


async def test_leaving_early_aborts_in_the_core():
    core = CountingCore()
    engine = AsyncEngine(lambda: core)
    async for _ in engine.generate(_request("b", max_tokens=10_000)):
        break
    for _ in range(100):
        if "b" in core.aborted:
            break
        await asyncio.sleep(0.01)
    assert "b" in core.aborted and not core.requests
    engine.shutdown(1)


async def test_failed_request_raises_and_others_continue():
    engine = AsyncEngine(CountingCore)

    async def run(rid):
        return [o async for o in engine.generate(_request(rid))]

    ok, failed = await asyncio.gather(run("good"), run("fail-1"), return_exceptions=True)
    assert isinstance(failed, RequestFailedError) and ok[-1].finished
    engine.shutdown(1)


async def test_full_queue_is_overloaded():
    engine = AsyncEngine(CountingCore, max_queued_requests=1)
    first = engine.generate(_request("c", max_tokens=10_000))
    await first.__anext__()
    with pytest.raises(EngineOverloadedError):
        await engine.generate(_request("d")).__anext__()
    await first.aclose()
    engine.shutdown(1)


def test_a_core_that_fails_to_build_fails_the_constructor():
    def broken():
        raise RuntimeError("weights missing")

    with pytest.raises(RuntimeError, match="weights missing"):
        AsyncEngine(broken)


async def test_stream_interval_sends_fewer_larger_chunks_under_load():
    from tests.unit.fakes import SlowCountingCore

    async def chunks(interval_s):
        engine = AsyncEngine(SlowCountingCore, stream_interval_s=interval_s)
        async def collect(rid):
            return [o async for o in engine.generate(_request(rid, max_tokens=40))]

        outputs = await asyncio.gather(collect("r0"), collect("r1"))  # two running: under load
        engine.shutdown(1)
        return outputs[0]

    every_token, gathered = await chunks(0.0), await chunks(0.05)
    assert [t for o in gathered for t in o.new_token_ids] == [t for o in every_token for t in o.new_token_ids]
    assert len(gathered) < len(every_token) / 3


async def test_chunk_rate_cap_grows_the_pause_with_the_number_of_streams():
    from tests.unit.fakes import SlowCountingCore

    async def chunks_per_stream(streams, rate):
        engine = AsyncEngine(SlowCountingCore, max_stream_chunks_per_s=rate)
        async def collect(rid):
            return [o async for o in engine.generate(_request(rid, max_tokens=40))]

        outputs = await asyncio.gather(*(collect(f"r{i}") for i in range(streams)))
        engine.shutdown(1)
        assert all(sum(len(o.new_token_ids) for o in out) == 40 for out in outputs)  # nothing dropped
        return max(len(out) for out in outputs)

    uncapped, two, four = await chunks_per_stream(2, 0), await chunks_per_stream(2, 40), await chunks_per_stream(4, 40)
    assert two < uncapped / 2
    assert four < two  # twice the streams under the same cap: each waits twice as long


async def test_a_lone_stream_is_never_held_back_by_the_chunk_rate_cap():
    from tests.unit.fakes import SlowCountingCore

    engine = AsyncEngine(SlowCountingCore, max_stream_chunks_per_s=1)
    outputs = [o async for o in engine.generate(_request("alone", max_tokens=10))]
    engine.shutdown(1)
    assert sum(len(o.new_token_ids) for o in outputs) == 10
    assert len(outputs) >= 5  # tokens come as made (merged only if the reader lags), not one per second


def test_tokens_queued_before_a_failure_go_out_before_it():
    from app.engine.async_engine import _merge_ready
    from app.engine.request import RequestOutput

    pending = asyncio.Queue()
    pending.put_nowait(RequestOutput("r", [8], " b", 1, 2))
    failure = RequestOutput("r", [], "", 1, 2, finished=True, finish_reason="error", error="step failed")
    pending.put_nowait(failure)
    pending.put_nowait(RequestOutput("r", [9], " c", 1, 3))  # never read: the failure ends the request
    merged, carry = _merge_ready(RequestOutput("r", [7], " a", 1, 1), pending)
    assert merged.new_token_ids == [7, 8] and merged.new_text == " a b" and not merged.finished
    assert carry is failure
    # an exception read while merging is handed back the same way
    pending = asyncio.Queue()
    pending.put_nowait(RuntimeError("engine died"))
    merged, carry = _merge_ready(RequestOutput("r", [7], " a", 1, 1), pending)
    assert merged.new_token_ids == [7] and isinstance(carry, RuntimeError)
