"""Where the engine core runs: its own process (``ProcessCore``) or a thread of the serving process
(``ThreadCore``), behind one connection that the serving event loop reads (app/engine/async_engine.py).

Why a process: the core's step is mostly Python driving torch (the transformers modules), so it
holds the GIL for much of every step. In one process with the server's event loop (and, under Ray
Serve, the replica's own threads), each streamed token made the core wait for the GIL while the
threads that held it waited for a CPU the core's OpenMP threads were using: single-stream decode
ran at ~60% of the core's own speed (measured on this 2-core machine). vLLM v1 runs its EngineCore
in a separate process for the same reason. The thread is for tests and ``separate_process: false``.

Both run the same loop (``serve_core``) over a socket pair: apply the commands that arrived, step,
send the step's outputs with fresh statistics and the draft calls it queued. The serving side only
sends commands and reads reports; it never calls the core itself, so it needs no thread of its own.

Messages, front to core: ``("add", [Request])``, ``("abort", request_id)``, ``("drafts", [DraftResult])``,
``("stop", None)``. Core to front: ``("ready", CoreInfo, stats)`` or ``("failed", message)`` once at start, then
``("outputs", [RequestOutput], stats, [DraftCall])`` after every step (also a step with no output: that is
the heartbeat the front holds against ``engine.step_timeout_s``) and after commands, and ``("died",
message)`` if the loop fails. If the front goes away the core sees its connection close and stops; if the
core's process dies the front reads end-of-file and reports the engine dead.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable, Protocol

from app.engine.request import Request, RequestOutput

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5  # the idle core's wait for a command (it wakes at once when one arrives)
# Room for a burst of commands (a batch of long prompts) while the core is inside a step: the front's
# sends then never wait for the core to read.
_SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


class EngineCore(Protocol):
    """Every call ``serve_core`` makes on a core (every batching mode implements it); one thread drives it."""

    def add_requests(self, requests: list[Request]) -> None: ...
    def abort_request(self, request_id: str) -> RequestOutput | None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def stats(self) -> dict[str, float]: ...
    def take_draft_calls(self) -> list: ...
    def add_draft_results(self, results: list) -> None: ...
    def idle_wait_s(self) -> float: ...  # how long it may wait for a command: 0 while it has a step to run


class EngineStartupError(RuntimeError):
    """The engine core could not be built (the message carries the core's error)."""


@dataclass
class CoreInfo:
    """What the serving side needs to know about the model the core loaded."""

    name: str
    tokenizer: Any
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    warmup_s: float
    sampling_defaults: dict = field(default_factory=dict)  # the checkpoint's, for fields a request leaves unset


CoreBuild = Callable[[], "tuple[EngineCore, Any]"]  # builds the core; returns it and what it says about itself


class _CoreHost:
    """The serving side's end of a running core: ``connection`` and ``info``, ``is_alive``, ``close``."""

    def __init__(self, build: CoreBuild) -> None:
        self.connection, core_end = multiprocessing.get_context("spawn").Pipe()  # duplex: a Unix socket pair
        for end in (self.connection, core_end):
            _widen_buffers(end)
        self._start(build, core_end)
        try:
            kind, payload, *stats = self.connection.recv()  # returns once the core is built and warmed up
        except EOFError:
            raise EngineStartupError(f"the engine core stopped while starting ({self.describe_exit()})") from None
        if kind != "ready":
            self._join(5)
            raise EngineStartupError(payload)
        self.info = payload
        self.initial_stats: dict[str, float] = stats[0]

    def _start(self, build: CoreBuild, core_end: Connection) -> None:
        raise NotImplementedError

    def is_alive(self) -> bool:
        raise NotImplementedError

    def describe_exit(self) -> str:
        raise NotImplementedError

    def _join(self, timeout_s: float) -> None:
        raise NotImplementedError

    def cut(self) -> None:
        """Shut the connection down both ways: a send blocked on it (a core that reads nothing) returns an error."""
        with contextlib.suppress(OSError):
            with socket.socket(fileno=os.dup(self.connection.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, wait up to ``timeout_s``, then close the connection."""
        if self.is_alive():
            try:
                self.connection.send(("stop", None))
            except OSError:
                pass  # already gone
            self._join(timeout_s)
        self.connection.close()


class ProcessCore(_CoreHost):
    """The core in a spawned process: a fresh interpreter, no inherited threads or locks."""

    def _start(self, build: CoreBuild, core_end: Connection) -> None:
        context = multiprocessing.get_context("spawn")
        self._process = context.Process(target=_process_main, args=(build, core_end), name="llm-engine-core", daemon=True)
        self._process.start()
        core_end.close()

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def describe_exit(self) -> str:
        # Its socket can close a moment before the process is reaped: wait that moment for the exit code.
        self._process.join(timeout=1.0)
        if self._process.exitcode is None:
            return "the engine process closed its connection and is still running"
        return f"the engine process exited with code {self._process.exitcode}"

    def _join(self, timeout_s: float) -> None:
        self._process.join(timeout=timeout_s)
        if self._process.is_alive():
            self._process.kill()  # a wedged step will not end by itself
            self._process.join(timeout=5)


class ThreadCore(_CoreHost):
    """The core on a thread of this process. Loading, warm-up and every step run on that one thread: OpenMP
    keeps a thread team per calling thread, and a core driven from another thread than the one that loaded
    it ran ~2x slower per step on a 2-core machine (measured), as two teams competed for the cores."""

    def _start(self, build: CoreBuild, core_end: Connection) -> None:
        self._thread = threading.Thread(target=_host, args=(build, core_end), name="engine-core", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def describe_exit(self) -> str:
        return "the engine thread ended"

    def _join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)  # a wedged step keeps the (daemon) thread: nothing can stop it


def _widen_buffers(connection: Connection) -> None:
    sock = socket.socket(fileno=connection.fileno())
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER_BYTES)
    finally:
        sock.detach()  # the descriptor stays the connection's


# ---- the core's side ------------------------------------------------------------------------------
def _process_main(build: CoreBuild, conn: Connection) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s [engine-core]: %(message)s")
    _exit_with_parent()
    _host(build, conn)


def _exit_with_parent() -> None:
    """End this process as soon as the serving process is gone (killed, out of memory): it would notice only at its
    next read of the socket, never while loading the model or inside a step that hangs, and meanwhile hold the
    model's memory the replica replacing its parent needs."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _host(build: CoreBuild, conn: Connection) -> None:
    """Build the core, say so, then serve commands until told to stop or the front goes away."""
    try:
        try:
            core, info = build()
        except BaseException as exc:  # noqa: BLE001 - reported to the front, which raises it
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            return
        conn.send(("ready", info, core.stats()))
        serve_core(core, conn)
    except (EOFError, OSError):
        pass  # the front is gone: nobody to serve
    except BaseException as exc:  # noqa: BLE001 - the loop failed: every request of this core is lost
        logger.exception("engine core loop died")
        try:
            conn.send(("died", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        conn.close()


def serve_core(core: EngineCore, conn: Connection) -> None:
    while True:
        pending: list[RequestOutput] = []
        changed = False  # commands change the statistics even when they produce no output
        wait = min(core.idle_wait_s(), _IDLE_POLL_S) if core.has_unfinished_requests() else _IDLE_POLL_S
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
        calls = core.take_draft_calls()
        if pending or changed or calls or stepped:
            conn.send(("outputs", pending, core.stats(), calls))
