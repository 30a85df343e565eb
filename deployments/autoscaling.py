"""Autoscaling on the engines' own load: each model replica reports its queue depth, a policy scales on it.

Serve's default policy scales on ongoing requests, which a model replica counts only while Serve hands
it work. Our replicas know better: the engine's waiting plus running sequences is the work a replica has,
whether it came through the HTTP proxy, another deployment's handle or a draft call. Every model-hosting
deployment (``LLMServer``, and ``OpenAIIngress`` for the model it hosts) reports it to Serve from
``record_autoscaling_stats`` (Serve's hook, called on each replica every metrics period) as
``engine_queue_depth``; Serve averages it over ``look_back_period_s`` per replica and hands the result
to ``QueueDepthPolicy`` in ``AutoscalingContext.aggregated_metrics``.

The policy returns the raw number of replicas the load needs. Serve wraps every custom policy with its
own scaling factors, ``upscale_delay_s`` / ``downscale_delay_s`` and the ``min_replicas`` /
``max_replicas`` bounds, so those behave as with the default policy.

This module imports nothing of the app: Serve pickles the policy by value into its controller.
"""

from __future__ import annotations

from typing import Any

QUEUE_DEPTH_METRIC = "engine_queue_depth"
POLICY_PATH = "deployments.autoscaling:QueueDepthPolicy"


def engine_queue_depth(stats: dict[str, Any]) -> dict[str, float]:
    """What a model replica reports to Serve: its engine's waiting plus running sequences."""
    return {QUEUE_DEPTH_METRIC: float(stats.get("num_waiting", 0) + stats.get("num_running", 0))}


def queue_depth_policy(ctx, target_queue_depth: float, metric: str = QUEUE_DEPTH_METRIC) -> tuple[float, dict[str, Any]]:
    """Replicas needed for every replica to hold ``target_queue_depth`` sequences (waiting + running).

    The load is the sum of the running replicas' reported depths, a replica that has not reported yet (up to a
    metrics period after it started, while Serve already routes to it) counted as their mean (as nothing, the
    new replica would read as spare capacity and undo the scale-up that made it), plus requests queued at
    callers for want of a free replica, which no engine sees yet. Where no running replica reports the metric
    (a deployment without the hook, or the hook failing), Serve's ongoing-request count against
    ``target_ongoing_requests`` decides, as Serve's default policy would (the builder sets it to the same target).
    """
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}  # Serve's cold start path decides from zero replicas
    reported = (ctx.aggregated_metrics or {}).get(metric) or {}
    depths = [reported[replica] for replica in ctx.running_replicas if replica in reported]
    if depths:
        unreported = len(ctx.running_replicas) - len(depths)
        load = sum(depths) * (1 + unreported / len(depths)) + (ctx.total_queued_requests or 0.0)
        target, signal = target_queue_depth, metric
    else:
        load, target, signal = ctx.total_num_requests or 0.0, ctx.config.get_target_ongoing_requests(), "ongoing_requests"
    # Within the bounds already: a wish beyond max_replicas is no pending decision for Serve's delays to count.
    desired = min(max(load / target, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
    return desired, {"signal": signal, "load": load}


class QueueDepthPolicy:
    """The policy Serve calls each control-loop tick (``autoscaling_config.policy``); kwargs from ``policy_kwargs``."""

    def __init__(self, target_queue_depth: float = 16, metric: str = QUEUE_DEPTH_METRIC) -> None:
        if not isinstance(target_queue_depth, (int, float)) or isinstance(target_queue_depth, bool) or target_queue_depth <= 0:
            raise ValueError(f"target_queue_depth must be a number > 0, got {target_queue_depth!r}")
        self.target_queue_depth = float(target_queue_depth)
        self.metric = metric

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        # A fraction of a replica is fine: Serve applies its scaling factors to it, then rounds up.
        return queue_depth_policy(ctx, self.target_queue_depth, self.metric)
