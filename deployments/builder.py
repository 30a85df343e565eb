"""``build_app(args)``: the import_path of serve_config.yaml. Config in, bound Serve application out."""

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
    config = AppConfig.from_args(args)
    servers = [LLMServer.options(**replica_options(served)).bind(served) for served in config.models]
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
