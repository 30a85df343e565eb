"""``build_app(args)``: the import_path of serve_config.yaml. Config in, bound Serve application out.

``args`` is the app config (app/config/), plus one optional key that is not config:
``server_factory``, the ``"module:attribute"`` import path of what each model replica serves
(default: the real ``app.server.ModelServer``; the serving tests name a fake model here).

Topology (``ingress_hosts_first_model``, default true): the ingress replicas host the first model
themselves, with that model's resources and scaling, so its streamed tokens take no Ray hop; every
other model is an ``LLMServer:<name>`` deployment behind the ingress. Set it false to make the ingress
a CPU-only router in front of one deployment per model (every model scaled on its own).
"""

from __future__ import annotations

import re
from typing import Any

from ray.serve import Application
from ray.serve.config import AutoscalingConfig

from app.config import AppConfig, ServedModelConfig
from deployments.autoscaling import POLICY_PATH
from deployments.drafting import INGRESS_DEPLOYMENT
from deployments.ingress import OpenAIIngress
from deployments.replica import LLMServer

DEFAULT_AUTOSCALING = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}
RETRY_AFTER_S = 1  # Serve's own 503 (its queue at a caller is full) tells clients when to come back, as ours do
# Serve runs a replica's code on an event loop of its own thread by default, so every streamed chunk crosses
# threads to reach the loop that writes HTTP. Ours never blocks its loop (bodies parse and engines stop on worker
# threads; the engine runs in its own process), so it shares Serve's loop: one hop less for every token.
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The OpenAIIngress, hosting the first model unless configured not to, in front of the other models."""
    args = dict(args or {})
    factory = args.pop("server_factory", None)
    config = AppConfig.from_args(args)
    extra = {"server_factory": factory} if factory is not None else {}  # unset: the replica's default, the real model
    local = config.models[0] if config.ingress_hosts_first_model else None
    remote = [served for served in config.models if served is not local]
    _require_distinct_deployment_names(remote)
    bound = [LLMServer.options(**replica_options(served), **affinity(config, served)).bind(served, **extra, **drafts(config, served, local))
             for served in remote]
    servers = [server for server, served in zip(bound, remote) for _ in served.served_names]
    names = [name for served in remote for name in served.served_names]
    ingress = OpenAIIngress.options(**ingress_options(config, local), **(affinity(config, local) if local is not None else {}))
    local_drafts = drafts(config, local, local) if local is not None else {}
    return ingress.bind(servers, names, config.max_request_bytes, local=local, **extra, **local_drafts)


def drafts(config: AppConfig, served: ServedModelConfig, local: ServedModelConfig | None) -> dict[str, Any]:
    """The ``draft_deployments`` argument of a model that drafts with another model of the app (else nothing)."""
    deployments = {
        index: INGRESS_DEPLOYMENT if local is not None and spec.draft == local.model.name else deployment_name(spec.draft)
        for index, spec in enumerate(served.engine.drafters) if spec.drafter == "model"
    }
    return {"draft_deployments": deployments} if deployments else {}


# By import path: Serve imports the router (deployments/routing.py) only for a deployment configured with it.
SEQUENCE_AFFINITY_ROUTER = "deployments.routing:SequenceAffinityRouter"


def affinity(config: AppConfig, served: ServedModelConfig) -> dict[str, Any]:
    """A draft model's deployment keeps each sequence's draft calls on one replica (deployments/routing.py)."""
    drafting = {spec.draft for m in config.models for spec in m.engine.drafters if spec.drafter == "model"}
    return {"request_router_config": {"request_router_class": SEQUENCE_AFFINITY_ROUTER}} if served.model.name in drafting else {}


def ingress_options(config: AppConfig, local: ServedModelConfig | None) -> dict[str, Any]:
    """A router's options, or those of the model it hosts; its request limit also covers what it relays."""
    # Serve's queue in front of the ingress (at the HTTP proxy) holds requests for every model
    queued = [served.replica.max_queued_requests for served in config.models]
    max_queued = -1 if -1 in queued else sum(queued)
    # what the other models' deployments take at their largest: relayed by any one ingress replica, however few
    relayed = sum(fleet_capacity(served) for served in config.models if served is not local)
    if local is None:  # a router that hosts no model only relays (one replica: it does little per request)
        return {"ray_actor_options": {"num_cpus": 0, **_runtime_env()},
                "max_ongoing_requests": relayed, **_backpressure(max_queued)}
    options = {key: value for key, value in replica_options(local).items() if key != "name"}
    options["max_ongoing_requests"] += relayed
    options.update(_backpressure(max_queued))
    return options


def fleet_capacity(served: ServedModelConfig) -> int:
    """The requests a model's deployment takes at once at its largest: each replica's limit times its most replicas."""
    most = autoscaling_config(served)["max_replicas"] if served.replica.autoscaled else served.replica.num_replicas
    return served.replica.max_ongoing_requests * most


def replica_options(served: ServedModelConfig) -> dict[str, Any]:
    """Deployment options from the config; serve_config.yaml `deployments:` entries still override them."""
    replica = served.replica
    num_gpus = replica.num_gpus if replica.num_gpus is not None else (1 if served.model.device == "cuda" else 0)
    options: dict[str, Any] = {
        "name": deployment_name(served.model.name),
        "ray_actor_options": {"num_cpus": replica.num_cpus, "num_gpus": num_gpus,
                              **({"memory": int(replica.memory_gb * 2**30)} if replica.memory_gb else {}),
                              **_runtime_env()},
        "max_ongoing_requests": replica.max_ongoing_requests,
        **_backpressure(replica.max_queued_requests),
    }
    if replica.autoscaled:
        options["autoscaling_config"] = autoscaling_config(served)
    else:
        options["num_replicas"] = replica.num_replicas
    if replica.max_replicas_per_node is not None:  # Serve's own spreading: at most this many per Ray node
        options["max_replicas_per_node"] = replica.max_replicas_per_node
    return options


def _runtime_env() -> dict[str, Any]:
    """Every replica's environment: REPLICA_ENV. Serve adds it to an application's own runtime_env (its env_vars
    merge), and a deployment's ray_actor_options in serve_config.yaml replace it."""
    return {"runtime_env": {"env_vars": dict(REPLICA_ENV)}}


def autoscaling_config(served: ServedModelConfig) -> dict[str, Any]:
    """Serve's autoscaling_config: the defaults, the config's own keys, and (unless it names a policy of its
    own) the policy that scales on the engines' queue depth (deployments/autoscaling.py)."""
    replica = served.replica
    policy = {"policy_function": POLICY_PATH, "policy_kwargs": {"target_queue_depth": replica.target_queue_depth}}
    # target_ongoing_requests: the same target where Serve's request count decides (no replica reported yet)
    merged = {**DEFAULT_AUTOSCALING, "target_ongoing_requests": replica.target_queue_depth, "policy": policy,
              **(replica.autoscaling_config or {})}
    _check_autoscaling(served.model.name, merged, replica.autoscaling_config or {})
    return merged


def _check_autoscaling(model: str, merged: dict[str, Any], given: dict[str, Any]) -> None:
    """At start, naming the model and the key: Serve passes unknown keys over, and names bounds it merged in."""
    unknown = sorted(set(given) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ValueError(f"model {model!r}: replica.autoscaling_config has unknown key(s) {', '.join(unknown)} "
                         f"(Serve's: {', '.join(AutoscalingConfig.model_fields)})")
    try:
        AutoscalingConfig(**merged)
    except ValueError as exc:  # pydantic's ValidationError is one
        reasons = ("; ".join(f"{'.'.join(map(str, error['loc'])) or 'the config'}: {error['msg']}" for error in exc.errors())
                   if hasattr(exc, "errors") else str(exc))
        defaults = {key: value for key, value in DEFAULT_AUTOSCALING.items() if key not in given}
        raise ValueError(f"model {model!r}: replica.autoscaling_config {given}, with the defaults {defaults}: {reasons}") from None


def _backpressure(max_queued_requests: int) -> dict[str, Any]:
    """Serve's bound on its queue at each caller; past it Serve answers 503 with Retry-After (docs/configuration.md)."""
    return {"max_queued_requests": max_queued_requests,
            "backpressure_config": {"status_code": 503, "retry_after_s": RETRY_AFTER_S}}


def deployment_name(model_name: str) -> str:
    return "LLMServer:" + re.sub(r"[^A-Za-z0-9_.-]", "-", model_name)


def _require_distinct_deployment_names(models: list[ServedModelConfig]) -> None:
    """Model names that differ only in ``/`` or ``:`` would share a deployment name, which Serve silently
    renames: draft calls and ``deployments:`` overrides would then reach the wrong model."""
    by_deployment: dict[str, list[str]] = {}
    for served in models:
        by_deployment.setdefault(deployment_name(served.model.name), []).append(served.model.name)
    for deployment, names in by_deployment.items():
        if len(names) > 1:
            raise ValueError(f"models {', '.join(names)} would all be deployment {deployment} (/ and : become -): "
                             "rename one (model.name)")
