"""Liveness and drain of one served model, without Ray: the engine's heartbeat against engine.step_timeout_s
(in the serving process and in an engine process of its own), and a drain that ends what is left explicitly."""

import asyncio
import time

import pytest

from app.api.errors import to_api_error
from app.api.protocol import CompletionRequest, parse_body
from app.config import ServedModelConfig
from app.engine import AsyncEngine, EngineDeadError, EngineOverloadedError, EngineShutdownError, Request, SamplingParams
from tests.serve.fake_model import WEDGE_RELEASE, fake_model_server
from tests.unit.fakes import CountingCore, in_thread, until

BOUND_S = 2.0  # engine.step_timeout_s in these tests: several of their steps, even on a loaded machine


def _server(separate_process: bool, step_timeout_s: float = BOUND_S):
    return fake_model_server(_config(separate_process, step_timeout_s))


def _config(separate_process: bool, step_timeout_s: float) -> ServedModelConfig:
    from app.config import AppConfig

    served = {"model": {"source": "fake-live"}, "engine": {"separate_process": separate_process, "step_timeout_s": step_timeout_s}}
    return AppConfig.from_dict({"models": [served]}).models[0]


def _completion(prompt: str, max_tokens: int = 50) -> CompletionRequest:
    return parse_body({"prompt": prompt, "max_tokens": max_tokens, "stream": True}, CompletionRequest)


async def _until_unhealthy(server, limit_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        try:
            server.check_health()
        except RuntimeError:
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    raise AssertionError(f"check_health still passes after {limit_s} s")


@pytest.mark.parametrize("separate_process", [False, True], ids=["in-process core", "engine process"])
async def test_a_wedged_engine_fails_its_health_check_within_the_bound_and_its_requests_explicitly(separate_process):
    WEDGE_RELEASE.clear()
    server = _server(separate_process)
    try:
        await asyncio.sleep(BOUND_S + 0.3)  # idle for longer than the bound: still healthy
        server.check_health()
        assert server.ready and server.healthy

        async def wedged():
            return [chunk async for chunk in server.serving.completion_stream(_completion("wedge-engine"))]

        stream = asyncio.ensure_future(wedged())
        took = await _until_unhealthy(server, limit_s=BOUND_S + 3)
        assert took <= BOUND_S + 1.5, took  # the stall counts from the last step, a fraction of a second before
        with pytest.raises(RuntimeError, match="no engine step completed"):
            server.check_health()
        assert not server.ready and not server.healthy
        with pytest.raises(EngineDeadError):  # the waiting client hears of it at once, as a 503 telling to retry
            await asyncio.wait_for(stream, timeout=2)
        assert to_api_error(stream.exception()).status == 503
        with pytest.raises(EngineDeadError):  # and new requests are refused
            await server.serving.completion(_completion("hello", max_tokens=2))
    finally:
        WEDGE_RELEASE.set()
        started = time.monotonic()
        server.shutdown(timeout_s=0)
        assert time.monotonic() - started < 5  # a wedged engine process is killed, not waited for


class _SlowSteps(CountingCore):
    """Each step takes 0.3 s: slow, but progressing."""

    def step(self):
        time.sleep(0.3)
        return super().step()


async def test_slow_steps_within_the_bound_stay_healthy():
    engine = AsyncEngine(in_thread(_SlowSteps), step_timeout_s=BOUND_S)
    outputs = [o async for o in engine.generate(Request("slow", [1], SamplingParams(max_tokens=8)))]  # ~2.4 s
    assert outputs[-1].finished and engine.is_healthy()
    engine.shutdown(1)


class _QuietSteps(CountingCore):
    """A long prefill: steps of 0.2 s that emit nothing for a while, then one token each."""

    def __init__(self):
        super().__init__()
        self.quiet_steps = 10

    def step(self):
        time.sleep(0.2)
        if self.quiet_steps:
            self.quiet_steps -= 1
            return []
        return super().step()


def build_quiet_core():
    return _QuietSteps(), "quiet-core-info"


async def test_an_engine_process_stepping_without_outputs_is_not_wedged():
    from app.engine.core_process import ProcessCore

    engine = AsyncEngine(ProcessCore(build_quiet_core), step_timeout_s=BOUND_S)
    try:
        generating = asyncio.ensure_future(_collect(engine, Request("quiet", [1], SamplingParams(max_tokens=2))))
        while not generating.done():  # 2 s without an output (the bound), at most 0.2 s between reports of the child
            assert engine.is_healthy(), engine.dead_reason
            await asyncio.sleep(0.1)
        assert (await generating)[-1].finished
    finally:
        engine.shutdown(1)


async def _collect(engine, request):
    return [o async for o in engine.generate(request)]


async def test_drain_refuses_new_requests_lets_short_ones_finish_and_ends_the_rest_explicitly():
    from tests.unit.fakes import SlowCountingCore

    engine = AsyncEngine(in_thread(SlowCountingCore))
    short = asyncio.ensure_future(_collect(engine, Request("short", [1], SamplingParams(max_tokens=20))))  # ~0.1 s
    long = asyncio.ensure_future(_collect(engine, Request("long", [1], SamplingParams(max_tokens=100_000))))
    await until(lambda: engine.num_running == 2)  # both in the core's batch
    draining = asyncio.ensure_future(engine.drain(timeout_s=2.0))  # short needs ~0.1 s of it
    await until(lambda: engine.draining)
    with pytest.raises(EngineOverloadedError, match="shutting down"):  # a 503 with Retry-After for its client
        await _collect(engine, Request("late", [1], SamplingParams(max_tokens=2)))
    assert await draining == 1  # one request was still running at the deadline
    assert (await short)[-1].finished
    with pytest.raises(EngineShutdownError):
        await long
    error = to_api_error(long.exception(), "req-1")
    assert error.status == 503 and error.code == "replica_unavailable" and "retry" in error.message
    await until(lambda: engine.stats()["num_running"] == 0)  # the ended request is aborted in the core: its KV is freed
    engine.shutdown(1)


def test_step_timeout_is_validated():
    with pytest.raises(ValueError, match="engine.step_timeout_s"):
        _config(False, 0)
    with pytest.raises(ValueError, match="engine.step_timeout_s"):
        _config(False, "60")
    assert _config(False, 0.5).engine.step_timeout_s == 0.5


class _PendingStream:
    """A relayed stream that yields nothing until cancelled, as a handle's stream of a long answer."""

    def __init__(self):
        self._cancelled = asyncio.Event()

    def cancel(self):
        self._cancelled.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self._cancelled.wait()
        raise RuntimeError("request cancelled")  # what Serve raises for a cancelled response


class _Handle:
    def options(self, **_):
        return self

    @property
    def completion_stream(self):
        return self

    def remote(self, request):
        return _PendingStream()


async def test_a_draining_ingress_ends_relayed_streams_with_an_explicit_error():
    from deployments.routes import Relayed, RemoteModel

    relayed = Relayed()
    chunks = RemoteModel(_Handle(), relayed).stream("completion", object())
    waiting = asyncio.ensure_future(chunks.__anext__())
    await until(lambda: len(relayed) == 1)
    assert relayed.cut_all() == 1
    with pytest.raises(EngineShutdownError):
        await waiting
    assert len(relayed) == 0


async def test_graceful_shutdown_drains_once_when_serve_begins_stopping_the_replica(monkeypatch):
    from deployments import lifecycle

    stopping, budgets = False, []
    monkeypatch.setattr(lifecycle, "stop_requested", lambda: stopping)
    monkeypatch.setattr(lifecycle, "POLL_S", 0.01)
    monkeypatch.setattr(lifecycle, "STALE_ROUTES_S", 0.2)

    async def drain(budget_s):
        budgets.append((budget_s, time.monotonic()))

    shutdown = lifecycle.GracefulShutdown(drain, timeout_s=60, wait_loop_s=2)
    await asyncio.sleep(0.05)  # five looks at the flag, none of which may start a drain
    assert not shutdown.started and not budgets
    stopping = True
    await until(lambda: shutdown.started)
    assert not budgets  # requests routed here before the routers learn of the stop are still admitted
    await until(lambda: budgets)
    (budget_s, drained_at), = budgets
    assert drained_at - shutdown.started_at >= 0.2
    assert budget_s == pytest.approx(60 - 2 - lifecycle._MARGIN_S - 0.2)  # the same deadline: before Serve's kill
    await shutdown.run()  # what __del__ does afterwards: the same drain, not a second one
    assert len(budgets) == 1
    shutdown.cancel()


@pytest.mark.parametrize("period_s, admitted_s", [(30.0, 30.0), (0.0, 1.0), (None, 1.0)])
def test_an_ingress_under_direct_ingress_admits_through_serves_draining_period(monkeypatch, period_s, admitted_s):
    """Serve keeps a stopping direct-ingress replica reachable for its draining period while load balancers deregister
    it: refusing after a second would answer their requests with 503s. Without direct ingress (0), or where this Ray
    has no such setting (None), the stale routes' second."""
    from deployments import lifecycle

    monkeypatch.setattr(lifecycle, "direct_ingress_draining_period_s", lambda: period_s)
    assert lifecycle.ingress_admission_after_stop_s() == admitted_s


async def test_admission_after_the_stop_takes_at_most_half_the_drain_window(monkeypatch):
    from deployments import lifecycle

    monkeypatch.setattr(lifecycle, "stop_requested", lambda: True)
    monkeypatch.setattr(lifecycle, "POLL_S", 0.01)
    budgets = []

    async def drain(budget_s):
        budgets.append((budget_s, time.monotonic()))

    shutdown = lifecycle.GracefulShutdown(drain, timeout_s=4.1, wait_loop_s=2, admit_after_stop_s=30)  # a 0.6 s window
    await until(lambda: budgets)
    (budget_s, drained_at), = budgets
    assert budget_s == pytest.approx(0.3) and 0.3 <= drained_at - shutdown.started_at < 1.0
    shutdown.cancel()


async def test_a_replica_stopped_from_del_drains_at_once(monkeypatch):
    from deployments import lifecycle

    monkeypatch.setattr(lifecycle, "stop_requested", lambda: False)
    budgets = []

    async def drain(budget_s):
        budgets.append(budget_s)

    shutdown = lifecycle.GracefulShutdown(drain, timeout_s=60, wait_loop_s=2)
    shutdown.cancel()
    started = time.monotonic()
    await shutdown.run()  # __del__: Serve routes nothing here any more
    assert time.monotonic() - started < lifecycle.STALE_ROUTES_S / 2
    assert budgets == [60 - 2 - lifecycle._MARGIN_S]


def test_a_warm_up_out_of_memory_says_which_settings_to_lower():
    from types import SimpleNamespace

    from app.engine.request import RequestOutput
    from app.server import _generate

    class OutOfMemory:
        def __init__(self):
            self.left = True

        def add_requests(self, requests):
            self.request = requests[0]

        def has_unfinished_requests(self):
            return self.left

        def step(self):
            self.left = False
            return [RequestOutput(self.request.request_id, [], "", 1, 0, finished=True, finish_reason="error",
                                  error="OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB")]

    with pytest.raises(RuntimeError, match="lower engine.kv_cache_memory_mb"):
        _generate(OutOfMemory(), SimpleNamespace(name="m"), Request("warmup", [1], SamplingParams(max_tokens=1)))


def test_a_warm_up_step_that_only_fit_smaller_says_so_and_which_settings_end_it(caplog):
    from app.server import _say_if_capped

    class Capped:
        def __init__(self, cap):
            self.cap = cap

        def stats(self):
            return {"step_token_cap": self.cap}

    with caplog.at_level("WARNING", logger="app.server"):
        _say_if_capped(Capped(2048), "m", 2048)
        assert not caplog.records
        _say_if_capped(Capped(512), "m", 2048)
    assert "steps carry at most 512 tokens" in caplog.text and "max_num_batched_tokens to 512" in caplog.text
