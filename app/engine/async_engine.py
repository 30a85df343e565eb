"""The async front of an engine: ``generate`` streams outputs, ``abort`` stops a request.

The engine core is not thread-safe and does blocking torch work, so it lives on one dedicated
thread. asyncio callers talk to it through an inbox (adds, aborts) and receive outputs through a
per-request asyncio.Queue fed with ``call_soon_threadsafe``; the event loop never blocks on torch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Protocol

from app.engine.draft_calls import DraftCallSender, DraftClient, core_idle_wait_s
from app.engine.request import Request, RequestOutput

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.05


class EngineCore(Protocol):
    """What every batching mode implements; driven from a single thread."""

    num_running: int
    num_waiting: int

    def add_requests(self, requests: list[Request]) -> None: ...
    def abort_request(self, request_id: str) -> RequestOutput | None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def stats(self) -> dict[str, float]: ...


class EngineOverloadedError(RuntimeError):
    """The engine's queue is full; the caller should retry later (HTTP 503)."""


class EngineQueueTimeoutError(EngineOverloadedError):
    """A request had no first token within ``max_queue_time_s``; the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an unrecoverable error; the replica must be replaced."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (the others went on)."""


class EngineShutdownError(RuntimeError):
    """The replica shut down before this request finished (its drain window ran out); the caller may retry."""


Admit = Callable[[Request], Awaitable[None]]


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for target, output in items:
        target.put_nowait(output)


def _merge_ready(first, pending: asyncio.Queue) -> tuple[RequestOutput | BaseException, BaseException | None]:
    """Fold outputs that queued up behind ``first`` into one delta; returns it and any failure read after it
    (an exception, or an output that ends the request with an error), which the caller takes next.

    When the consumer (a slow client, or the streaming path under load) falls behind the engine,
    it then sends one chunk with several tokens instead of one chunk per token, so per-chunk
    overhead shrinks exactly when it matters; an idle consumer still gets every token at once.
    """
    merged = first
    while isinstance(merged, RequestOutput) and not merged.finished and not pending.empty():
        nxt = pending.get_nowait()
        if not isinstance(nxt, RequestOutput) or nxt.finish_reason == "error":
            return merged, nxt  # the tokens before a failure go out first; the failure ends the stream next
        merged = merged.followed_by(nxt)
    return merged, None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Runs an engine core on its own thread; ``build_core`` is called on that thread.

    All torch work (loading, warm-up, every step) happens on that one thread: OpenMP keeps a thread
    team per calling thread, and a core driven from a different thread than the one that loaded it
    ran ~2x slower per step on a 2-core machine (measured), as two teams compete for the cores.
    """

    def __init__(
        self,
        build_core: Callable[[], EngineCore],
        max_queued_requests: int = 1024,
        stream_interval_s: float = 0.0,
        max_stream_chunks_per_s: float = 0.0,
        max_queue_time_s: float = 0.0,
        draft_client: DraftClient | None = None,
        step_timeout_s: float = 60.0,
    ) -> None:
        """``step_timeout_s``: how long the engine may go without completing a step while requests wait
        before ``is_healthy`` reports it wedged (a step that never returns, an engine process that stopped
        answering)."""
        self._drafts = DraftCallSender(draft_client, lambda results: self._post(("drafts", results)))
        self._step_timeout_s = step_timeout_s
        self._last_progress = time.monotonic()  # the engine thread's heartbeat (see _beat)
        self._draining = False
        self._max_queued = max_queued_requests
        self._max_queue_time_s = max_queue_time_s  # > 0: the deadline of a request's first token
        self._stream_interval_s = stream_interval_s
        self._max_chunk_rate = max_stream_chunks_per_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._dead_reason: str | None = None
        self._core: EngineCore | None = None
        self._started = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(build_core,), name="engine-loop", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._startup_error is not None:
            raise self._startup_error
        self.started_at = time.time()

    @property
    def core(self) -> EngineCore:
        return self._core

    # ---- asyncio side -------------------------------------------------------------------
    async def generate(self, request: Request, admit: Admit | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of ``request``; leaving the loop early (cancel, disconnect) aborts it.

        ``admit`` hands the request to the engine (default: at once, alone); the replica passes its
        ``@serve.batch`` window, which gathers concurrent arrivals into one group. With ``max_queue_time_s``,
        a request with no first token that long after it came here ends with EngineQueueTimeoutError (and
        leaves the engine); a request that has had its first token is never timed out.
        """
        arrived = time.monotonic()
        self._check_accepting()
        self._drafts.bind_loop(asyncio.get_running_loop())
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request.request_id in self._streams:
                raise ValueError(f"request id {request.request_id!r} is already running")
            self._streams[request.request_id] = stream
        finished = False
        try:
            if admit is None:
                self.add_group([request])
            else:
                await admit(request)
            carry = None  # an exception read while merging, raised on the next turn
            deadline = arrived + self._max_queue_time_s if self._max_queue_time_s > 0 else None
            while not finished:
                item = carry if carry is not None else await self._next_output(stream.queue, deadline)
                deadline = None  # only the first token has a deadline: from then on the request is in the batch
                item, carry = _merge_ready(item, stream.queue)
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason == "error":
                    raise RequestFailedError(item.error or "request failed in the engine")
                finished = item.finished
                yield item
                pause = self._chunk_pause_s()
                if pause and not finished:
                    await asyncio.sleep(pause)
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            if not finished:
                self.abort(request.request_id)

    async def _next_output(self, outputs: asyncio.Queue, deadline: float | None):
        if deadline is None:
            return await outputs.get()
        try:
            return await asyncio.wait_for(outputs.get(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise EngineQueueTimeoutError(
                f"no place for this request on the replica within {self._max_queue_time_s:g} s "
                "(engine.max_queue_time_s); retry later"
            ) from None

    def _chunk_pause_s(self) -> float:
        """How long a stream lets tokens gather after sending a chunk (0 for a lone request).

        Under load, fewer and larger chunks: each chunk costs CPU on every hop of the streaming path
        (replica, ingress, proxy; ~4 ms in all on a 2-core AVX2 EPYC), CPU the engine shares on
        small machines. ``max_stream_chunks_per_s`` caps all streams together, so the pause grows
        with the number of running requests; ``stream_interval_s`` is a floor per stream.
        """
        running = self._core.num_running
        if running <= 1:
            return 0.0
        by_rate = running / self._max_chunk_rate if self._max_chunk_rate else 0.0
        return max(self._stream_interval_s, by_rate)

    def add_group(self, requests: list[Request]) -> None:
        """Hand requests whose streams are open to the engine as one group (thread-safe, returns at once)."""
        self._post(("add", list(requests)))

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV memory is freed on the engine's next iteration."""
        self._post(("abort", request_id))

    def _post(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake_core()

    def _wake_core(self) -> None:
        """A core in another process makes the loop wait for its outputs; end that wait so the command goes now."""
        wakeup = getattr(self._core, "wakeup", None)
        if wakeup is not None:
            wakeup()

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    def is_healthy(self) -> bool:
        """The loop runs, and has completed a step within ``step_timeout_s`` or has nothing to do.

        A wedged engine (a step that never returns while requests wait, or an engine process that
        stopped answering) is declared dead here: its requests end with EngineDeadError at once,
        and the replica's health check fails so Serve replaces it.
        """
        if self._dead_reason is None and self._thread.is_alive():
            stalled_s = self.stalled_s
            if stalled_s > self._step_timeout_s:
                self._declare_dead(f"no engine step completed in {stalled_s:.1f} s (engine.step_timeout_s: "
                                   f"{self._step_timeout_s:g}) with {self.num_unfinished} request(s) waiting")
        return self._dead_reason is None and self._thread.is_alive()

    @property
    def stalled_s(self) -> float:
        """Seconds since the engine last made progress (completed a step) or was idle."""
        return time.monotonic() - self._last_progress

    @property
    def draining(self) -> bool:
        return self._draining

    def _declare_dead(self, reason: str) -> None:
        logger.error("engine declared dead: %s", reason)
        self._dead_reason = reason
        self._fail_all(EngineDeadError(f"engine stopped: {reason}"))

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def stats(self) -> dict[str, float]:
        # Read from another thread without a lock: each figure is a plain int read, possibly one step old.
        return {"num_requests": self.num_unfinished, **self._core.stats()}

    def begin_drain(self) -> None:
        """Admit nothing more (new requests: EngineOverloadedError, a 503 telling to retry elsewhere)."""
        self._draining = True

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting, let the requests in flight finish within ``timeout_s``, then end the rest with
        EngineShutdownError (an explicit error for their callers, never a silent cut); returns how many were ended."""
        self.begin_drain()
        deadline = time.monotonic() + timeout_s
        while self.num_unfinished and time.monotonic() < deadline and self.is_healthy():
            await asyncio.sleep(0.05)
        return self._end_remaining()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Let the requests in flight finish (up to ``timeout_s``), end the rest with an error, then stop the loop."""
        self.begin_drain()
        deadline = time.monotonic() + timeout_s
        while self.num_unfinished and time.monotonic() < deadline and self.is_healthy():
            time.sleep(0.05)
        self._end_remaining()
        healthy = self.is_healthy()
        self._stopping.set()
        self._wake_core()
        self._thread.join(timeout=5 if healthy else 0.5)
        close = getattr(self._core, "close", None)  # a core in another process stops it
        if close is not None:
            close(timeout_s=10.0 if healthy else 1.0)  # a wedged engine process will not stop by itself

    def _end_remaining(self) -> int:
        with self._lock:
            streams = list(self._streams.values())
        if streams:
            logger.warning("ending %d request(s) still running at shutdown", len(streams))
        error = EngineShutdownError("the replica shut down before this request finished")
        for stream in streams:  # each stream raises it, and its generator aborts the request in the core
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        return len(streams)

    def _check_accepting(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(f"engine stopped: {self._dead_reason}")
        if self._draining or self._stopping.is_set():
            raise EngineOverloadedError("the replica is shutting down; retry on another replica")
        if self.num_unfinished >= self._max_queued:
            raise EngineOverloadedError(
                f"the replica already holds {self._max_queued} requests, all its batch and queue take "
                "(engine.max_num_seqs + engine.max_queued_requests); retry later"
            )

    # ---- engine thread ------------------------------------------------------------------
    def _run(self, build_core: Callable[[], EngineCore]) -> None:
        try:
            self._core = build_core()
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor's caller
            self._startup_error = exc
            return
        finally:
            self._started.set()
        try:
            while not self._stopping.is_set():
                busy = self._core.has_unfinished_requests()
                if not busy:
                    self._last_progress = time.monotonic()  # idle: nothing waits on the core
                self._drain_inbox(timeout=self._idle_wait_s() if busy else _IDLE_POLL_S)
                if self._core.has_unfinished_requests():
                    outputs = self._core.step()
                    self._beat()
                    self._deliver(outputs)
                self._send_draft_calls()
        except BaseException as exc:  # noqa: BLE001 - anything here ends the loop, so tell every caller
            logger.exception("engine loop died")
            self._dead_reason = f"{type(exc).__name__}: {exc}"
            self._fail_all(EngineDeadError(f"engine stopped: {self._dead_reason}"))

    def _beat(self) -> None:
        """A step returned: progress, unless the core only waited for another process that sent nothing
        (a core in another process says when it last heard from it)."""
        heard = getattr(self._core, "last_progress", None)
        self._last_progress = time.monotonic() if heard is None else max(self._last_progress, heard)

    def _idle_wait_s(self) -> float:
        """0 while the core has a step to run; longer while all its sequences wait for drafts (a command wakes it)."""
        return min(core_idle_wait_s(self._core), _IDLE_POLL_S)

    def _drain_inbox(self, timeout: float) -> None:
        try:
            command = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
            while True:
                self._apply(command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _apply(self, command: tuple) -> None:
        kind, payload = command
        if kind == "add":
            with self._lock:  # a request cancelled before it reached us is dropped here
                live = [request for request in payload if request.request_id in self._streams]
            if live:
                self._core.add_requests(live)
        elif kind == "abort":
            self._core.abort_request(payload)
        elif kind == "drafts":
            self._core.add_draft_results(payload)

    def _send_draft_calls(self) -> None:
        take = getattr(self._core, "take_draft_calls", None)  # engine.speculative drafter: model
        self._drafts.send(take() if take is not None else [])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One wake-up per event loop per step, not one per request: at batch 32 the difference is
        # 32 self-pipe writes and loop iterations every step.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
