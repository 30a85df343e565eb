"""Draft calls of an engine whose drafter is a draft model elsewhere (app/spec/remote.py), sent from its front.

The engine core (in its own process or on a thread) only queues ``DraftCall`` s, which come to the front
with its step reports; this sends each one on the serving event loop through the ``DraftClient`` the
replica gave (a Serve handle to the draft model's deployment) and posts the ``DraftResult`` back to the core
as a command. A failed or lost call comes back as
a result with an error: it costs speed (the drafter stands down for a while), never output.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from typing import Any, Awaitable, Callable

logger = logging.getLogger(__name__)

# Sends one draft call (app/spec/remote.py DraftCall) to the draft model and returns its DraftResult.
DraftClient = Callable[[Any], Awaitable[Any]]
DRAFT_CALL_TIMEOUT_S = 30.0


class DraftCallSender:
    def __init__(self, client: DraftClient | None, post_results: Callable[[list], None]) -> None:
        self._client = client
        self._post_results = post_results  # hands results to the engine core
        self._in_flight: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    def send(self, calls: list) -> None:
        """Send calls (on the serving loop); each result is posted back when it arrives."""
        if not calls:
            return
        if self._client is None:
            self._post_results([_failed(call, "no draft model is reachable from this replica") for call in calls])
            return
        loop = asyncio.get_running_loop()
        for call in calls:
            # A call belongs to no client request: in an empty context it carries no request's id (Serve files a
            # handle call under the request whose context it runs in, and cancels it with that request).
            task = contextvars.Context().run(loop.create_task, self._send_one(call))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _send_one(self, call) -> None:
        started = time.monotonic()
        # Every call is answered, even one cancelled under it: its sequence asks again only once answered.
        result = _failed(call, "the draft call was cancelled")
        try:
            result = await asyncio.wait_for(self._client(call), DRAFT_CALL_TIMEOUT_S)
            result = dataclasses.replace(result, elapsed_s=time.monotonic() - started)
        except asyncio.CancelledError:
            logger.warning("draft call for %s was cancelled", call.sequence_id)
            raise
        except Exception as exc:  # noqa: BLE001 - a lost draft costs speed, never output: report and go on
            logger.warning("draft call for %s failed: %s: %s", call.sequence_id, type(exc).__name__, exc)
            result = _failed(call, f"{type(exc).__name__}: {exc}")
        finally:
            self._post_results([result])


def _failed(call, error: str):
    from app.spec.remote import DraftResult  # the engine front imports nothing of app.spec unless drafts go out

    return DraftResult(call.call_id, call.drafter, call.sequence_id, [], error=error)
