"""``build_app(args)``: the import_path of serve_config.yaml. Config in, bound Serve application out.

``args`` is the app config (app/config.py), plus one optional key that is not config:
``server_factory``, the ``"module:attribute"`` import path of what each model replica serves
(default: the real ``app.server.ModelServer``; the serving tests name a fake model here).
"""

from __future__ import annotations

import re
from typing import Any

from ray.serve import Application

from app.config import AppConfig, ServedModelConfig
from deployments.ingress import OpenAIIngress
from deployments.replica import LLMServer

DEFAULT_AUTOSCALING = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}


def build_app(args: dict[str, Any] | None = None) -> Application:
    """One LLMServer deployment per configured model, behind one OpenAIIngress."""
    args = dict(args or {})
    factory = args.pop("server_factory", None)
    config = AppConfig.from_args(args)
    extra = {"server_factory": factory} if factory is not None else {}  # unset: the replica's default, the real model
    servers = [LLMServer.options(**replica_options(served)).bind(served, **extra) for served in config.models]
    names = [served.model.name for served in config.models]
    return OpenAIIngress.bind(servers, names, config.max_request_bytes)


def replica_options(served: ServedModelConfig) -> dict[str, Any]:
    """Deployment options from the config; serve_config.yaml `deployments:` entries still override them."""
    replica = served.replica
    num_gpus = replica.num_gpus if replica.num_gpus is not None else (1 if served.model.device == "cuda" else 0)
    options: dict[str, Any] = {
        "name": deployment_name(served.model.name),
        "ray_actor_options": {"num_cpus": replica.num_cpus, "num_gpus": num_gpus},
        "max_ongoing_requests": replica.max_ongoing_requests,
    }
    if replica.num_replicas == "auto" or replica.autoscaling_config:
        options["autoscaling_config"] = {**DEFAULT_AUTOSCALING, **(replica.autoscaling_config or {})}
    else:
        options["num_replicas"] = replica.num_replicas
    return options


def deployment_name(model_name: str) -> str:
    return "LLMServer:" + re.sub(r"[^A-Za-z0-9_.-]", "-", model_name)
