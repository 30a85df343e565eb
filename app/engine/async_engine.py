"""The async front of an engine: ``generate`` streams outputs, ``abort`` stops a request.

The engine core runs elsewhere (its own process, or a thread: app/engine/core_process.py) and talks
over one connection. The serving event loop reads that connection itself (``add_reader``): each
report of a step is fanned out to the per-request asyncio queues in the same callback. Commands
(adds, aborts, draft results) go out in order on a sender thread, so the loop never blocks on a full
connection or on torch.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
import threading
import time
import weakref
from typing import AsyncIterator, Awaitable, Callable

from app.engine.core_process import CoreInfo, ProcessCore, ThreadCore
from app.engine.draft_calls import DraftCallSender, DraftClient
from app.engine.errors import (EngineDeadError, EngineOverloadedError, EngineQueueTimeoutError, EngineShutdownError,
                               ReplicaDrainingError, RequestFailedError, engine_failure)
from app.engine.request import Request, RequestOutput
from app.engine.reservation import Reservation
from app.engine.stream_pacing import StreamPacing, merge_ready

logger = logging.getLogger(__name__)

CoreHost = ProcessCore | ThreadCore
_MAX_REPORTS_PER_READ = 16
_STOP_SENDING = object()  # ends the sender thread
_SENDER_JOIN_S = 5.0  # at shutdown, for the commands queued before it


Admit = Callable[[Request], Awaitable[None]]


class AsyncEngine:
    """Streams a running core's outputs to asyncio callers. Every method but ``shutdown`` runs on the serving
    event loop; the loop that first calls ``generate`` (or ``drain``) reads the core's reports."""

    def __init__(
        self,
        host: CoreHost,
        max_queued_requests: int = 1024,
        stream_interval_s: float = 0.0,
        max_stream_chunks_per_s: float = 0.0,
        max_queue_time_s: float = 0.0,
        draft_client: DraftClient | None = None,
        step_timeout_s: float = 60.0,
    ) -> None:
        """``step_timeout_s``: how long the core may go without reporting a step while requests wait before
        ``is_healthy`` reports it wedged (a step that never returns, an engine process that stopped answering)."""
        self._host = host
        self._conn = host.connection
        self._fileno = self._conn.fileno()  # still known once the connection is closed (to stop reading it)
        # Commands go out on a thread of their own: a send waits while the core's end is full (a long prompt while
        # the core itself waits to hand over a large report, e.g. prompt logprobs); on the serving loop it would stop
        # the loop reading reports, and the two would wait on each other for good.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=_send_commands, name="engine-commands", daemon=True,
                                        args=(self._outbox, self._conn, weakref.WeakMethod(self._send_failed)))
        self._sender.start()
        weakref.finalize(self, self._outbox.put, _STOP_SENDING)  # an engine dropped without shutdown: the thread ends
        self._drafts = DraftCallSender(draft_client, lambda results: self._send(("drafts", results)))
        self._step_timeout_s = step_timeout_s
        self._max_queued = max_queued_requests
        self._reserved = 0  # places held for generations not started yet (reserve)
        self._max_queue_time_s = max_queue_time_s  # > 0: the deadline of a request's first token
        self._pacing = StreamPacing(stream_interval_s, max_stream_chunks_per_s)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that reads the core's reports
        self._streams: dict[str, asyncio.Queue] = {}
        self._in_core: set[str] = set()  # requests the core holds (added, not yet finished or aborted)
        self._core_stats: dict[str, float] = dict(host.initial_stats)  # until its first report
        self._last_progress = time.monotonic()  # the last report, or when the core last became busy
        self._draining = False
        self._stopping = False
        self._dead_reason: str | None = None
        self.started_at = time.time()

    @property
    def info(self) -> CoreInfo:
        return self._host.info

    # ---- requests -----------------------------------------------------------------------------
    async def generate(self, request: Request, admit: Admit | None = None,
                       reservation: Reservation | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of ``request``; leaving the loop early (cancel, disconnect) aborts it.

        ``admit`` hands the request to the engine (default: at once, alone); the replica passes its
        ``@serve.batch`` window, which gathers concurrent arrivals into one group. With ``max_queue_time_s``,
        a request with no first token that long after it came here ends with EngineQueueTimeoutError (and
        leaves the engine); a request that has had its first token is never timed out. ``reservation``: where its
        place was held (``reserve``), which it takes.
        """
        arrived = time.monotonic()
        self.check_accepting(reserved=reservation is not None)
        self._attach()
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already running")
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = outputs
        if reservation is not None:
            reservation.take()
        finished = False
        try:
            if admit is None:
                self.add_group([request])
            else:
                await admit(request)
            carry = None  # an exception read while merging, raised on the next turn
            deadline = arrived + self._max_queue_time_s if self._max_queue_time_s > 0 else None
            while not finished:
                item = carry if carry is not None else await self._next_output(outputs, deadline)
                deadline = None  # only the first token has a deadline: from then on the request is in the batch
                if self._pacing.paced:
                    item, carry = merge_ready(item, outputs)
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason == "error":
                    raise engine_failure(item.error, item.phase_times)
                finished = item.finished
                yield item
                pause = self._chunk_pause_s()
                if pause and not finished:
                    await asyncio.sleep(pause)
        finally:
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
        """How long a stream lets tokens gather after sending a chunk (app/engine/stream_pacing.py)."""
        return self._pacing.pause_s(self.num_running)

    def add_group(self, requests: list[Request]) -> None:
        """Hand requests whose streams are open to the core as one group (returns at once)."""
        live = [request for request in requests if request.request_id in self._streams]  # not cancelled meanwhile
        if not live:
            return
        if not self._in_core:
            self._last_progress = time.monotonic()  # the core becomes busy: its heartbeat counts from now
        self._in_core.update(request.request_id for request in live)
        self._send(("add", live))

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV memory is freed on the core's next iteration."""
        if request_id in self._in_core:
            self._in_core.discard(request_id)  # whatever the core still sends for it has no reader
            self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        if self._dead_reason is not None or self._stopping:
            return  # nobody reads it: every request was already ended with an error
        self._outbox.put(command)  # in order, by the sender thread

    def _send_failed(self, command: tuple, error: Exception) -> None:
        """On the sender thread: a lost connection is a dead core; a command that could not be written (its
        request does not pickle) fails its requests alone."""
        if isinstance(error, OSError):
            if not self._stopping:
                self._declare_dead(f"the engine core stopped ({self._host.describe_exit()}): {error}")
            return
        logger.error("could not send %s to the engine core: %s: %s", command[0], type(error).__name__, error)
        if command[0] == "add":
            failed = RequestFailedError(f"{type(error).__name__}: {error}")
            self._on_loop(lambda: self._fail_unsent([request.request_id for request in command[1]], failed))

    def _fail_unsent(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            self._in_core.discard(request_id)
            if (stream := self._streams.get(request_id)) is not None:
                stream.put_nowait(error)

    # ---- the core's reports, read on the serving loop ------------------------------------------
    def _attach(self) -> None:
        """Read the core's reports on the running loop (once; again if that loop was closed, as between tests)."""
        loop = asyncio.get_running_loop()
        if loop is self._loop or self._dead_reason is not None:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise RuntimeError("an AsyncEngine serves one event loop at a time")
        self._loop = loop
        # Registered from whichever request came first, the reader would run (and start tasks) in that request's
        # context for the engine's whole life: it serves every request, so it runs in none.
        contextvars.Context().run(loop.add_reader, self._fileno, self._read_reports)

    def _read_reports(self) -> None:
        try:
            for _ in range(_MAX_REPORTS_PER_READ):  # then the loop's other work: a core faster than its reader
                if not self._conn.poll():           # must not starve the streams it feeds
                    break
                kind, *payload = self._conn.recv()
                if kind == "outputs":
                    self._deliver(*payload)
                elif kind == "died":
                    raise _CoreDied(payload[0])
        except (EOFError, OSError, _CoreDied) as exc:
            self._detach()
            if not self._stopping:
                reason = str(exc) if isinstance(exc, _CoreDied) else self._host.describe_exit()
                self._declare_dead(reason)

    def _deliver(self, outputs: list[RequestOutput], stats: dict[str, float], draft_calls: list) -> None:
        self._core_stats = stats
        self._last_progress = time.monotonic()
        for output in outputs:
            if output.finished:
                self._in_core.discard(output.request_id)
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)
        self._drafts.send(draft_calls)

    def _detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fileno)

    # ---- health and counters -----------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_running(self) -> int:
        return int(self._core_stats.get("num_running", 0))

    @property
    def num_waiting(self) -> int:
        return int(self._core_stats.get("num_waiting", 0))

    def stats(self) -> dict[str, float]:
        return {"num_requests": self.num_unfinished, **self._core_stats}

    def is_healthy(self) -> bool:
        """The core runs, and has reported a step within ``step_timeout_s`` or has nothing to do.

        A wedged core (a step that never returns while requests wait, or an engine process that
        stopped answering) is declared dead here: its requests end with EngineDeadError at once,
        and the replica's health check fails so Serve replaces it.
        """
        alive = self._host.is_alive()  # asked every time: it also reaps an engine process that has exited
        if self._dead_reason is None and not alive and not self._stopping:
            self._declare_dead(self._host.describe_exit())
        if self._dead_reason is None and self.stalled_s > self._step_timeout_s:
            self._declare_dead(f"no engine step completed in {self.stalled_s:.1f} s (engine.step_timeout_s: "
                               f"{self._step_timeout_s:g}) with {self.num_unfinished} request(s) waiting")
        return self._dead_reason is None

    @property
    def stalled_s(self) -> float:
        """Seconds since the core last reported while it holds requests (0 while it holds none)."""
        return time.monotonic() - self._last_progress if self._in_core else 0.0

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def _declare_dead(self, reason: str) -> None:
        logger.error("engine declared dead: %s", reason)
        self._dead_reason = reason
        self._end_all(EngineDeadError(f"engine stopped: {reason}"))
        # its last report no longer describes anything: a dead replica shows no load (autoscaling reads it)
        self._core_stats = {**self._core_stats, "num_running": 0, "num_waiting": 0, "kv_usage": 0.0}

    # ---- drain and shutdown ------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self._draining

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
        """Let the requests in flight finish (up to ``timeout_s``, when the serving loop runs on another thread),
        end the rest with an error, then stop the core. Callable from any thread, more than once."""
        if self._stopping:
            return
        self.begin_drain()
        deadline = time.monotonic() + timeout_s
        while self.num_unfinished and time.monotonic() < deadline and self.is_healthy():
            time.sleep(0.05)
        self._end_remaining()
        healthy = self.is_healthy()
        self._stopping = True
        self._on_loop(self._detach)
        self._outbox.put(_STOP_SENDING)  # the commands already queued go first (the core reads them before "stop")
        self._sender.join(timeout=_SENDER_JOIN_S)
        if self._sender.is_alive():  # stuck writing to a core that reads nothing: cut the connection, kill the core
            self._host.cut()
            healthy = False
        self._host.close(timeout_s=10.0 if healthy else 1.0)  # a wedged engine process is killed

    def _end_remaining(self) -> int:
        count = len(self._streams)
        if count:
            logger.warning("ending %d request(s) still running at shutdown", count)
        self._end_all(EngineShutdownError("the replica shut down before this request finished"))
        return count

    def _end_all(self, error: BaseException) -> None:
        """Every open stream raises ``error`` next (and its generator aborts the request in the core)."""
        def put() -> None:
            for stream in list(self._streams.values()):
                stream.put_nowait(error)

        self._on_loop(put)

    def _on_loop(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the serving loop: now if this is its thread (or no loop runs), else as its next callback."""
        loop = self._loop
        if loop is None or loop.is_closed() or _running_loop() is loop or not loop.is_running():
            call()
        else:
            loop.call_soon_threadsafe(call)

    @property
    def capacity(self) -> int:
        """The most requests this replica holds at once, running and queued (one more is refused: overloaded)."""
        return self._max_queued

    def reserve(self, count: int) -> Reservation:
        """Hold ``count`` places for one OpenAI request's generations, or raise what they would be refused with."""
        self.check_accepting(count)
        return Reservation(self, count)

    def check_accepting(self, count: int = 1, reserved: bool = False) -> None:
        """Raise what ``count`` requests arriving now would be refused with (EngineDeadError, ReplicaDrainingError,
        EngineOverloadedError), before they reach the engine; ``reserved``: their places are held (``reserve``)."""
        if self._dead_reason is not None:
            raise EngineDeadError(f"engine stopped: {self._dead_reason}")
        if self._draining or self._stopping:
            raise ReplicaDrainingError("the replica is shutting down; retry on another replica")
        if not reserved and self.num_unfinished + self._reserved + count > self._max_queued:
            held = (f"the replica already holds {self._max_queued} requests" if count == 1 else
                    f"this request's {count} generations do not fit: the replica holds {self.num_unfinished} of "
                    f"{self._max_queued} requests")
            raise EngineOverloadedError(
                f"{held}, all its batch and queue take (engine.max_num_seqs + engine.max_queued_requests); retry later"
            )


def _send_commands(outbox: queue.SimpleQueue, conn, failed: weakref.WeakMethod) -> None:
    """The sender thread: every command in order until told to stop. It holds no reference to its engine (only a
    weak one, to report a failure), so an engine nobody shut down is still collected."""
    while (command := outbox.get()) is not _STOP_SENDING:
        try:
            conn.send(command)
        except Exception as exc:  # noqa: BLE001 - the engine decides what it means
            if (report := failed()) is not None:
                report(command, exc)
            if isinstance(exc, OSError):
                return


class _CoreDied(Exception):
    """The core's loop failed and said why."""


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
