"""Every Ray Serve internal this app reads, in one place: each behind a function that never raises and degrades
safely where the internal is gone, and checked once at start (:func:`check_ray_internals`), which logs one
warning per missing internal naming what degrades.

Ray 2.60 (pinned) has no public API for these: whether Serve began stopping a replica, the replica's
graceful-shutdown settings, the id of the request being served, and the power-of-two-choices router to extend.
``tests/unit/test_ray_compat.py`` checks each against the installed Ray, so an upgrade that moves one fails a
test rather than a user.
"""

from __future__ import annotations

import logging
import uuid
from typing import Mapping

logger = logging.getLogger(__name__)

# What degrades where each internal is gone (the start-up warning says it).
DEGRADES = {
    "replica stop flag": "a replica notices Serve stopping it only when __del__ runs, after Serve's own drain: "
                         "long streams may be cut without an error event",
    "replica deployment config": "the drain budget uses the deployment's declared grace period, not the live one",
    "request context": "request ids come from the x-request-id header (or are made up): log lines and error "
                       "messages no longer carry Serve's own id",
    "direct ingress draining period": "a stopping ingress replica behind a load balancer refuses new requests (503) "
                                      "after a second rather than over the window Serve keeps it reachable",
    "power-of-two router": "draft calls are routed to any replica of the draft model, without sequence affinity "
                           "(each call recomputes its context instead of resuming its KV)",
}


def replica_stop_requested() -> bool:
    """Whether Serve began stopping this replica: its replica object's ``_shutting_down`` (False outside a
    replica, or where Serve keeps no such flag)."""
    replica = _replica_impl()
    return bool(getattr(replica, "_shutting_down", False)) if replica is not None else False


def replica_drain_settings() -> tuple[float, float] | None:
    """This replica's live ``(graceful_shutdown_timeout_s, graceful_shutdown_wait_loop_s)``, or None."""
    try:
        from ray import serve

        config = serve.get_replica_context()._deployment_config
        return float(config.graceful_shutdown_timeout_s), float(config.graceful_shutdown_wait_loop_s)
    except Exception:  # noqa: BLE001 - outside a replica, or another Ray
        return None


def serve_request_id(headers: Mapping[str, str] | None = None) -> str:
    """Serve's id for the request being served (its proxy returns it as the x-request-id header and its log lines
    carry it); else the request's own x-request-id header; else a fresh id."""
    try:
        from ray import serve

        request_id = serve.context._get_serve_request_context().request_id
    except Exception:  # noqa: BLE001 - another Ray: the header still names the request
        request_id = None
    return request_id or (headers or {}).get("x-request-id") or uuid.uuid4().hex


def direct_ingress_draining_period_s() -> float | None:
    """How long Serve keeps a stopping ingress replica reachable on its own port so that load balancers deregister
    it (``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S``, 30 s by default), 0.0 without direct ingress; None where
    the setting moved."""
    try:
        from ray.serve._private import constants

        if not constants.RAY_SERVE_ENABLE_DIRECT_INGRESS:
            return 0.0
        return float(constants.RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S)
    except Exception:  # noqa: BLE001 - another Ray
        return None


def power_of_two_router_class() -> type | None:
    """Serve's default request router (power of two choices on queue length), to extend; None where it moved."""
    try:
        from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
    except Exception:  # noqa: BLE001 - another Ray: routing.py falls back to the public base class
        return None
    return PowerOfTwoChoicesRequestRouter


def check_ray_internals() -> dict[str, bool]:
    """Which internals this Ray has (inside a replica also those only a replica can see); one warning per missing
    one, naming what degrades. Returns name -> available."""
    found = {"request context": _has_request_context(), "power-of-two router": power_of_two_router_class() is not None,
             "direct ingress draining period": direct_ingress_draining_period_s() is not None}
    if _in_replica():
        found["replica stop flag"] = hasattr(_replica_impl(), "_shutting_down")
        found["replica deployment config"] = replica_drain_settings() is not None
    for name, available in found.items():
        if not available:
            logger.warning("this Ray has no %s: %s", name, DEGRADES[name])
    return found


def _in_replica() -> bool:
    try:
        from ray import serve

        serve.get_replica_context()  # public: raises outside a replica
    except Exception:  # noqa: BLE001
        return False
    return True


def _replica_impl():
    """The Serve replica object of the actor this code runs in (None outside a replica or where it moved)."""
    try:
        from ray._private import worker

        actor = worker.global_worker.actors.get(worker.global_worker.actor_id)
        return getattr(actor, "_replica_impl", None)
    except Exception:  # noqa: BLE001 - not in an actor, or another Ray
        return None


def _has_request_context() -> bool:
    try:
        from ray import serve

        return callable(serve.context._get_serve_request_context)
    except Exception:  # noqa: BLE001 - another Ray
        return False


def serve_namespace() -> str:
    """The Ray namespace ``serve run`` initializes Ray in (deployments/launch.py starts Ray there for it); Serve's
    own name for it, "serve", where the constant has moved."""
    try:
        from ray.serve._private.constants import SERVE_NAMESPACE
    except ImportError:
        return "serve"
    return SERVE_NAMESPACE
