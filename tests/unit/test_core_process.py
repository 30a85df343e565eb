"""The engine core in a spawned process, with a fake core: streaming, startup errors, a dying child."""

import asyncio

import pytest

from app.engine import AsyncEngine, EngineDeadError, Request, SamplingParams
from app.engine.core_process import EngineStartupError, ProcessCore
from tests.unit import fakes


async def test_outputs_stream_back_and_aborts_reach_the_engine_process():
    host = ProcessCore(fakes.build_counting_core)
    assert host.info == "counting-core-info"
    engine = AsyncEngine(host)
    tokens = [t async for o in engine.generate(Request("a", [1], SamplingParams(max_tokens=4))) for t in o.new_token_ids]
    assert tokens == [0, 1, 2, 3]
    stream = engine.generate(Request("long", [1], SamplingParams(max_tokens=10_000)))
    await stream.__anext__()
    await stream.aclose()  # the client went away
    await fakes.until(lambda: engine.stats()["num_running"] == 0)  # the child reports the abort
    engine.shutdown(1)
    assert not host.is_alive()


def test_a_core_that_cannot_start_raises_its_error_in_the_parent():
    with pytest.raises(EngineStartupError, match="RuntimeError: weights missing"):
        ProcessCore(fakes.build_broken_core)


async def test_a_dead_engine_process_fails_requests_and_health():
    engine = AsyncEngine(ProcessCore(fakes.build_dying_core))
    with pytest.raises(EngineDeadError, match="exited with code 3"):
        async for _ in engine.generate(Request("x", [1], SamplingParams(max_tokens=3))):
            pass
    assert not engine.is_healthy()
    engine.shutdown(1)


async def test_a_core_loop_that_fails_reports_why_and_fails_its_requests():
    engine = AsyncEngine(ProcessCore(fakes.build_raising_core))
    with pytest.raises(EngineDeadError, match="ValueError: step broke"):
        async for _ in engine.generate(Request("x", [1], SamplingParams(max_tokens=3))):
            pass
    assert not engine.is_healthy() and "step broke" in engine.dead_reason
    engine.shutdown(1)


async def test_an_abort_after_shutdown_sends_nothing():
    engine = AsyncEngine(ProcessCore(fakes.build_counting_core))
    stream = engine.generate(Request("late", [1], SamplingParams(max_tokens=10_000)))
    await stream.__anext__()
    engine.shutdown(0)  # ends the stream with an error; its abort then has no core to reach
    with pytest.raises(Exception, match="shut down"):
        await stream.__anext__()
    assert engine.dead_reason is None  # a stopped engine is not a dead one
