"""The engine core in its own process, behind the same core contract (add / abort / step).

Why a process: the core's step is mostly Python driving torch (the transformers modules), so it
holds the GIL for much of every step. In one process with the server's event loop (and, under Ray
Serve, the replica's own threads), each streamed token made the core wait for the GIL while the
threads that held it waited for a CPU the core's OpenMP threads were using: single-stream decode
ran at ~60% of the core's own speed (measured on this 2-core machine). vLLM v1 runs its EngineCore
in a separate process for the same reason.

The child builds the core (load, warm-up), then loops: apply commands, step, send the step's
outputs together with fresh statistics. The parent side (:class:`ProcessCore`) is driven by
``AsyncEngine``'s thread exactly like an in-process core. If the parent goes away, the child sees
the pipe close and exits; if the child dies, the parent's next read fails and the engine is
reported dead (the replica's health check then fails and Serve replaces it). If the child stops
answering (a step that never returns), the parent's steps keep returning nothing: the time of the
child's last report is the heartbeat that ``AsyncEngine`` holds against ``engine.step_timeout_s``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

from app.engine.draft_calls import core_idle_wait_s
from app.engine.request import Request, RequestOutput

logger = logging.getLogger(__name__)

# The parent's wait for outputs ends when they arrive or when ``wakeup`` says a command is queued;
# this is only the longest wait with neither. (It used to poll every 2 ms: 500 wake-ups a second
# on the serving side, which cost a one-sequence stream ~3 ms a token on the 2-core machine.)
_STEP_WAIT_S = 0.5
_IDLE_POLL_S = 0.5  # the idle child's wait for a command (it wakes at once when one arrives)


class EngineStartupError(RuntimeError):
    """The engine process could not build its core (the message carries the child's error)."""


@dataclass
class CoreInfo:
    """What the serving side needs to know about the model the core loaded."""

    name: str
    tokenizer: Any
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    warmup_s: float


class ProcessCore:
    """Parent-side handle implementing the engine-core contract over a pipe."""

    def __init__(self, build: Callable[[], tuple[Any, CoreInfo]]) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads or locks
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_child_main, args=(build, child_conn), name="llm-engine-core", daemon=True)
        self._process.start()
        child_conn.close()
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise EngineStartupError(f"the engine process exited with code {self._process.exitcode} while starting") from None
        if kind != "ready":
            self._process.join(timeout=5)
            raise EngineStartupError(payload)
        self.info: CoreInfo = payload
        self._live: set[str] = set()
        self._stats: dict[str, float] = {}
        self._draft_calls: list = []  # the child's draft calls, until the driver takes them
        # When the child last reported (it does after every step): the engine's heartbeat while requests run.
        self.last_progress = time.monotonic()
        self._wake_r, self._wake_w = os.pipe()  # a byte here ends the step's wait (see wakeup)
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()  # close() must not free the fd number while a wakeup writes to it

    def wakeup(self) -> None:
        """Make a ``step`` waiting for outputs return now (thread-safe): the driver has commands to send."""
        with self._wake_lock:
            if self._wake_w < 0:
                return  # closed: a late abort after shutdown has nothing to wake
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full: a wake-up is pending anyway

    def add_requests(self, requests: list[Request]) -> None:
        self._conn.send(("add", requests))
        self._live.update(r.request_id for r in requests)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if request_id in self._live:
            self._conn.send(("abort", request_id))
            self._live.discard(request_id)  # whatever the child still sends for it has no reader
        return None

    def take_draft_calls(self) -> list:
        calls, self._draft_calls = self._draft_calls, []
        return calls

    def add_draft_results(self, results: list) -> None:
        self._conn.send(("drafts", results))

    def has_unfinished_requests(self) -> bool:
        # Unread messages count too: the last statistics after an abort must still be read.
        return bool(self._live) or self._conn.poll(0)

    def step(self) -> list[RequestOutput]:
        ready = wait([self._conn, self._wake_r], timeout=_STEP_WAIT_S)
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        if self._conn not in ready:
            return []  # woken for a command (or the safety-net timeout): the driver sends it, then steps again
        _, outputs, self._stats, calls = self._conn.recv()  # EOFError if the child died: the engine loop reports it
        self.last_progress = time.monotonic()
        self._draft_calls.extend(calls)
        for output in outputs:
            if output.finished:
                self._live.discard(output.request_id)
        return outputs

    @property
    def num_running(self) -> int:
        return int(self._stats.get("num_running", 0))

    @property
    def num_waiting(self) -> int:
        return int(self._stats.get("num_waiting", 0))

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    def close(self, timeout_s: float = 10.0) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=timeout_s)
        if self._process.is_alive():
            self._process.kill()
        self._conn.close()
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1


# ---- the child process ------------------------------------------------------------------------
def _child_main(build: Callable[[], tuple[Any, CoreInfo]], conn) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s [engine-core]: %(message)s")
    try:
        core, info = build()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", info))
    try:
        _serve(core, conn)
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone: nobody to serve


def _serve(core, conn) -> None:
    while True:
        pending: list[RequestOutput] = []
        changed = False  # commands change the statistics even when they produce no output
        wait = min(core_idle_wait_s(core), _IDLE_POLL_S) if core.has_unfinished_requests() else _IDLE_POLL_S
        while conn.poll(wait):
            changed = True
            kind, payload = conn.recv()
            if kind == "stop":
                return
            if kind == "add":
                core.add_requests(payload)
            elif kind == "abort":
                aborted = core.abort_request(payload)
                if aborted is not None:
                    pending.append(aborted)
            elif kind == "drafts":
                core.add_draft_results(payload)
            wait = 0
        stepped = core.has_unfinished_requests()
        if stepped:
            pending.extend(core.step())
        calls = core.take_draft_calls() if hasattr(core, "take_draft_calls") else []
        # After every step, even one without outputs (a prefill chunk): the parent reads it as the heartbeat.
        if pending or changed or calls or stepped:
            conn.send(("outputs", pending, core.stats(), calls))
