"""AsyncEngine with a small fake core on an engine thread: streaming, abort on early exit, overload, failures,
and how streams pace their chunks under load."""

import asyncio
import os
import socket
import threading
import time

import pytest

from app.engine import AsyncEngine, EngineOverloadedError, Request, RequestFailedError, SamplingParams
from app.engine.errors import EngineDeadError
from app.engine.core_process import EngineStartupError, ThreadCore
from tests.unit.fakes import CountingCore, SlowCountingCore, in_thread, until


def _request(rid, max_tokens=3):
    return Request(rid, [1], SamplingParams(max_tokens=max_tokens))


async def test_streams_until_finished():
    engine = AsyncEngine(in_thread())
    outputs = [o async for o in engine.generate(_request("a"))]
    assert [t for o in outputs for t in o.new_token_ids] == [0, 1, 2]
    assert outputs[-1].num_output_tokens == 3 and outputs[-1].finished
    engine.shutdown(1)


async def test_leaving_early_aborts_in_the_core():
    core = CountingCore()
    engine = AsyncEngine(in_thread(lambda: core))
    async for _ in engine.generate(_request("b", max_tokens=10_000)):
        break
    await until(lambda: "b" in core.aborted)
    assert not core.requests
    engine.shutdown(1)


async def test_failed_request_raises_and_others_continue():
    engine = AsyncEngine(in_thread())

    async def run(rid):
        return [o async for o in engine.generate(_request(rid))]

    ok, failed = await asyncio.gather(run("good"), run("fail-1"), return_exceptions=True)
    assert isinstance(failed, RequestFailedError) and ok[-1].finished
    engine.shutdown(1)


async def test_full_queue_is_overloaded():
    engine = AsyncEngine(in_thread(), max_queued_requests=1)
    first = engine.generate(_request("c", max_tokens=10_000))
    await first.__anext__()
    with pytest.raises(EngineOverloadedError):
        await engine.generate(_request("d")).__anext__()
    await first.aclose()
    engine.shutdown(1)


def test_a_core_that_fails_to_build_fails_the_constructor():
    def broken():
        raise RuntimeError("weights missing")

    with pytest.raises(EngineStartupError, match="RuntimeError: weights missing"):
        in_thread(broken)


def _paced(running: int, **options) -> float:
    """The pause a stream takes after a chunk while ``running`` requests run in the core."""
    engine = AsyncEngine(in_thread(), **options)
    engine._core_stats = {"num_running": running}  # as the core's last report said
    try:
        return engine._chunk_pause_s()
    finally:
        engine.shutdown(0)


def test_stream_interval_is_a_floor_per_stream_under_load_and_nothing_alone():
    assert _paced(1, stream_interval_s=0.05) == 0.0  # a lone request gets every token at once
    assert _paced(2, stream_interval_s=0.05) == 0.05


def test_the_chunk_rate_cap_grows_the_pause_with_the_number_of_streams():
    assert _paced(1, max_stream_chunks_per_s=1) == 0.0  # never held back alone
    assert _paced(2, max_stream_chunks_per_s=40) == pytest.approx(2 / 40)
    assert _paced(4, max_stream_chunks_per_s=40) == pytest.approx(4 / 40)  # all streams together keep the cap
    assert _paced(4, max_stream_chunks_per_s=40, stream_interval_s=0.5) == 0.5
    assert _paced(8) == 0.0  # neither set: every token as it comes


async def test_paced_streams_merge_tokens_into_fewer_chunks_and_drop_none():
    engine = AsyncEngine(in_thread(SlowCountingCore), max_stream_chunks_per_s=40)

    async def collect(rid):
        return [o async for o in engine.generate(_request(rid, max_tokens=40))]

    outputs = await asyncio.gather(*(collect(f"r{i}") for i in range(4)))
    engine.shutdown(1)
    for chunks in outputs:
        assert [t for o in chunks for t in o.new_token_ids] == list(range(40))  # every token, in order
        assert sum(o.finished for o in chunks) == 1 and chunks[-1].finished
    # 40 tokens of 5 ms steps take 0.2 s; paced at 0.1 s a chunk, a stream cannot have sent one chunk per token
    assert min(len(chunks) for chunks in outputs) < 40


async def test_unpaced_a_consumer_that_falls_behind_still_gets_a_chunk_per_token():
    """stream_interval_ms 0 and no chunk cap (the defaults): every token streamed as a chunk of its own, also the
    tokens that queued up while the consumer was busy."""
    engine = AsyncEngine(in_thread(SlowCountingCore))
    chunks = []
    async for output in engine.generate(_request("behind", max_tokens=10)):
        chunks.append(output)
        await asyncio.sleep(0.03)  # ~6 steps of the core meanwhile
    engine.shutdown(1)
    assert [o.new_token_ids for o in chunks] == [[t] for t in range(10)]
    assert chunks[-1].finished


async def test_a_dead_engine_reports_no_load():
    """Its last report would keep the replica's running/waiting figures (and the autoscaler's queue depth) up
    until Serve replaces it."""
    class DiesOnThirdStep(CountingCore):
        steps = 0

        def step(self):
            self.steps += 1
            if self.steps == 3:
                raise ValueError("step broke")
            return super().step()

    engine = AsyncEngine(ThreadCore(lambda: (DiesOnThirdStep(), None)))

    async def run(i):
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate(Request(f"r{i}", [1, 2], SamplingParams(max_tokens=50))):
                pass

    await asyncio.gather(*(run(i) for i in range(3)))
    stats = engine.stats()
    assert not engine.is_healthy() and (stats["num_running"], stats["num_waiting"], stats["num_requests"]) == (0, 0, 0)


async def test_a_long_prompt_sent_while_the_core_hands_over_a_large_report_does_not_deadlock():
    """Both ends of the socket full at once: the core waits to hand over a 16 MB report (prompt logprobs of a long
    prompt can be that large) while a 3M-token prompt goes the other way. Sent from the serving loop, the prompt
    stopped the loop reading reports, and neither end ever moved again (a watchdog cuts the socket after 30 s)."""
    front_sends = threading.Event()

    class LargeReportWhileTheFrontSends(CountingCore):
        def step(self):
            if not front_sends.is_set():
                time.sleep(0.01)
                return super().step()
            front_sends.clear()
            time.sleep(0.2)  # inside a step, reading no command, while the front's send fills the socket
            outputs = super().step()
            for output in outputs:
                output.new_text = "y" * 16_000_000
            return outputs

    engine = AsyncEngine(ThreadCore(lambda: (LargeReportWhileTheFrontSends(), None)))
    watchdog = threading.Timer(30, lambda: socket.socket(fileno=os.dup(engine._conn.fileno())).shutdown(socket.SHUT_RDWR))
    watchdog.start()

    async def run(request_id: str, prompt: list[int], max_tokens: int) -> int:
        return sum([1 async for _ in engine.generate(Request(request_id, prompt, SamplingParams(max_tokens=max_tokens)))])

    try:
        streaming = asyncio.create_task(run("streaming", [1], 200))
        await asyncio.sleep(0.1)
        front_sends.set()
        assert await run("long", [100_000] * 3_000_000, 2) >= 1  # ~15 MB pickled
        assert await streaming >= 1
    finally:
        watchdog.cancel()
        engine.shutdown(1)


async def test_a_request_that_cannot_be_sent_to_the_core_fails_alone():
    """A command that does not pickle (a request holding a local function) fails its request; the sender goes on."""
    engine = AsyncEngine(in_thread())
    bad = _request("bad")
    bad.callback = lambda output: None  # nothing the API builds: a Python caller's own attribute
    async def run(request):
        return [o async for o in engine.generate(request)]

    try:
        with pytest.raises(RequestFailedError, match="pickle"):
            await asyncio.wait_for(run(bad), timeout=10)
        assert (await asyncio.wait_for(run(_request("good")), timeout=10))[-1].finished
    finally:
        engine.shutdown(1)


def test_an_engine_dropped_without_shutdown_leaves_no_thread_behind():
    import gc

    engine = AsyncEngine(in_thread())
    del engine
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.name == "engine-commands" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "engine-commands" for t in threading.enumerate())
