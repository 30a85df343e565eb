"""A replica's graceful shutdown: what Ray Serve 2.60 does, and what our replicas add to it.

How Serve stops a replica (a redeploy, ``serve.delete``, a scale-down, a failed health check): the
controller takes it out of the routing tables, calls the actor's ``perform_graceful_shutdown`` and
force-kills the actor ``graceful_shutdown_timeout_s`` later, whatever it is doing. Inside, the replica
waits until no request is ongoing (looking every ``graceful_shutdown_wait_loop_s``, with no deadline of
its own), then rejects new handle requests (their routers retry elsewhere), stops its servers and only
then calls the user's ``__del__`` (``async def`` allowed, run on the replica's event loop). No other
hook exists: ``__del__`` comes after the drain, and a stream still running at the deadline is cut by
the kill, its HTTP response ending without a word.

So each model-hosting replica watches for the stop itself (``GracefulShutdown``): Serve flags its
replica object as shutting down when the stop arrives, read here every half second. The routers in front
(the proxy's, an ingress's) learn of the stop over Serve's long poll a moment later, and route requests here
until then: for ``STALE_ROUTES_S`` the replica still admits them, as Serve itself serves them, rather than
refusing with a 503 that a client of a scale-down would read. An ingress replica under Serve's direct ingress
(its own port, a load balancer in front) admits for Serve's draining period instead (up to half the drain window):
Serve keeps it reachable that long so that load balancers deregister it (its ``/health/ready`` says draining from
the stop on), and they send it requests until then. From then on the replica admits nothing new
(``ReplicaDrainingError``: an ingress sends such a refused call to another replica, deployments/routes.py; a
client reads 503 with Retry-After only where none takes it), lets what is in flight finish, and ends what is
still running shortly before the kill with an explicit error (an SSE error event, a 503), so Serve's own drain
completes in time. ``__del__`` then only releases the engine. (Both the flag and the replica's live grace period
are Ray internals: ``ray_compat.py``.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from deployments.ray_compat import (check_ray_internals, direct_ingress_draining_period_s, replica_drain_settings,
                                    replica_stop_requested)

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often a replica looks whether Serve began stopping it
# How long a stopped replica still admits requests: the routers' update comes over Serve's long poll, a moment after
# the stop (a scale-down on 2 busy cores routed a request here 18 ms after the controller removed this replica).
# Taken from the drain window (at most half of it).
STALE_ROUTES_S = 1.0
# Kept back from the grace period: Serve notices the drain's end one wait loop late, then stops its servers.
_MARGIN_S = 1.5


def stop_requested() -> bool:
    """Whether Serve began stopping this replica (False outside a replica, or where Serve keeps no such flag)."""
    return replica_stop_requested()


def ingress_admission_after_stop_s() -> float:
    """How long a stopping ingress replica still admits: under direct ingress, Serve's draining period, while load
    balancers deregister it; else ``STALE_ROUTES_S``."""
    return max(STALE_ROUTES_S, direct_ingress_draining_period_s() or 0.0)


def drain_budget_s(default_timeout_s: float, default_wait_loop_s: float) -> float:
    """How long requests in flight may run once the stop arrived, so that they end before the kill."""
    timeout_s, wait_loop_s = replica_drain_settings() or (default_timeout_s, default_wait_loop_s)
    return max(0.0, timeout_s - wait_loop_s - _MARGIN_S)


class GracefulShutdown:
    """Runs ``drain(budget_s)`` once: ``admit_after_stop_s`` after Serve begins stopping this replica, or at the latest
    from ``__del__`` (Serve has then stopped routing here: no wait).

    ``drain`` stops admitting, lets requests in flight finish within ``budget_s`` and ends the rest with an
    error. Created in a replica's constructor (it needs the running event loop).
    """

    def __init__(self, drain: Callable[[float], Awaitable[object]], timeout_s: float, wait_loop_s: float,
                 admit_after_stop_s: float | None = None) -> None:
        """``admit_after_stop_s``: how long the replica still admits once Serve began stopping it (at most half the
        drain window; default ``STALE_ROUTES_S``)."""
        self._drain = drain
        self._defaults = (timeout_s, wait_loop_s)
        self._admit_after_stop_s = STALE_ROUTES_S if admit_after_stop_s is None else admit_after_stop_s
        self._running: asyncio.Future | None = None
        self.started_at: float | None = None
        check_ray_internals()  # warns, naming what degrades, where this Ray lacks one
        self._watch = asyncio.get_running_loop().create_task(self._watch_for_stop())

    @property
    def started(self) -> bool:
        return self.started_at is not None

    async def _watch_for_stop(self) -> None:
        while not stop_requested():
            await asyncio.sleep(POLL_S)
        logger.info("Serve is stopping this replica: draining after %.1f s for requests still routed here",
                    self._admit_after_stop_s)
        await self.run(admit_for_s=self._admit_after_stop_s)

    async def run(self, admit_for_s: float = 0.0) -> None:
        """Drain, after admitting for ``admit_for_s`` more (once; a second caller waits for the first)."""
        if self._running is None:
            self.started_at = time.monotonic()
            self._running = asyncio.ensure_future(self._drain_after(admit_for_s))
        await asyncio.shield(self._running)

    async def _drain_after(self, admit_for_s: float) -> None:
        budget_s = drain_budget_s(*self._defaults)
        admit_for_s = min(admit_for_s, budget_s / 2)
        await asyncio.sleep(admit_for_s)
        await self._drain(budget_s - admit_for_s)

    def cancel(self) -> None:
        self._watch.cancel()
