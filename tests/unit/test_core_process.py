"""The engine core in a spawned process, with a fake core: streaming, startup errors, a dying child."""

import asyncio

import pytest

from app.engine import AsyncEngine, EngineDeadError, Request, SamplingParams
from app.engine.core_process import EngineStartupError, ProcessCore
from tests.unit import fakes


async def test_outputs_stream_back_and_aborts_reach_the_engine_process():
    core = ProcessCore(fakes.build_counting_core)
    assert core.info == "counting-core-info"
    engine = AsyncEngine(lambda: core)
    tokens = [t async for o in engine.generate(Request("a", [1], SamplingParams(max_tokens=4))) for t in o.new_token_ids]
    assert tokens == [0, 1, 2, 3]
    stream = engine.generate(Request("long", [1], SamplingParams(max_tokens=10_000)))
    await stream.__anext__()
    await stream.aclose()  # the client went away
    for _ in range(200):
        if engine.stats()["num_running"] == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.stats()["num_running"] == 0 and not core.has_unfinished_requests()
    engine.shutdown(1)
    assert not core._process.is_alive()


def test_a_core_that_cannot_start_raises_its_error_in_the_parent():
    with pytest.raises(EngineStartupError, match="RuntimeError: weights missing"):
        ProcessCore(fakes.build_broken_core)


async def test_a_dead_engine_process_fails_requests_and_health():
    core = ProcessCore(fakes.build_dying_core)
    engine = AsyncEngine(lambda: core)
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate(Request("x", [1], SamplingParams(max_tokens=3))):
            pass
    assert not engine.is_healthy()
    engine.shutdown(1)


def test_a_queued_command_ends_the_wait_for_outputs_at_once(monkeypatch):
    """The parent waits for outputs without polling; wakeup() (sent with every command) ends the wait."""
    import threading
    import time

    from app.engine import core_process

    monkeypatch.setattr(core_process, "_STEP_WAIT_S", 30.0)  # only a wake-up can end this wait in time
    core = ProcessCore(fakes.build_counting_core)
    returned = threading.Event()
    waiting = threading.Thread(target=lambda: (core.step(), returned.set()))
    waiting.start()
    time.sleep(0.2)
    assert not returned.is_set()  # nothing to read: still waiting
    core.wakeup()
    assert returned.wait(10)  # woken, not timed out (30 s)
    waiting.join()
    core.close()


def test_a_wakeup_after_close_does_nothing():
    core = ProcessCore(fakes.build_counting_core)
    core.close()
    core.wakeup()  # e.g. an abort from a stream that ended after shutdown: no write to a freed descriptor
