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
    await fakes.until(lambda: (engine.is_healthy(), engine._host._process.exitcode)[1] is not None)  # reaped: no zombie
    engine.shutdown(1)
    engine.shutdown(1)  # a second shutdown (another thread's, a finalizer's) is a no-op


async def test_an_abort_after_shutdown_sends_nothing():
    engine = AsyncEngine(ProcessCore(fakes.build_counting_core))
    stream = engine.generate(Request("late", [1], SamplingParams(max_tokens=10_000)))
    await stream.__anext__()
    engine.shutdown(0)  # ends the stream with an error (after the tokens already queued); its abort then has no core
    with pytest.raises(Exception, match="shut down"):
        async for _ in stream:
            pass
    assert engine.dead_reason is None  # a stopped engine is not a dead one


def test_the_engine_process_ends_with_the_serving_process_even_while_loading():
    """A serving process killed (out of memory, say) while its engine process loads the model: that process must not
    live on holding the model's memory (it touches the socket only once loaded)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", (
        "import threading, time, multiprocessing\n"
        "from app.engine.core_process import ProcessCore\n"
        "from tests.unit import fakes\n"
        "threading.Thread(target=ProcessCore, args=(fakes.build_forever_loading_core,), daemon=True).start()\n"
        "while not multiprocessing.active_children(): time.sleep(0.05)\n"
        "print(multiprocessing.active_children()[0].pid, flush=True)\n"
        "time.sleep(3600)\n")], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as stat:
            if stat.read().split(")")[-1].split()[0] == "Z":  # exited; only its reaping is left (to init)
                return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the engine process outlived the serving process by 20 s")


async def test_shutdown_ends_even_while_a_long_prompt_is_stuck_on_its_way_to_a_wedged_core(monkeypatch):
    """The sender thread blocked writing a 15 MB prompt to a core that reads nothing more: shutdown cuts the
    connection and kills the core instead of waiting on the send for good."""
    import threading
    import time

    from app.engine import async_engine

    monkeypatch.setattr(async_engine, "_SENDER_JOIN_S", 0.5)
    engine = AsyncEngine(ProcessCore(fakes.build_wedging_core), step_timeout_s=60)
    await engine.generate(Request("wedge", [1], SamplingParams(max_tokens=50))).__anext__()
    stuck = asyncio.ensure_future(engine.generate(Request("long", [100_000] * 3_000_000, SamplingParams(max_tokens=2))).__anext__())
    await asyncio.sleep(1.0)
    stopping = threading.Thread(target=engine.shutdown, args=(0,), daemon=True)
    started = time.monotonic()
    stopping.start()
    while stopping.is_alive() and time.monotonic() - started < 20:
        await asyncio.sleep(0.1)  # the loop runs on: the streams' errors are delivered meanwhile
    assert not stopping.is_alive(), "shutdown waited on a send to a wedged core"
    assert not engine._host.is_alive()
    with pytest.raises(Exception):
        await stuck
