"""A served model inside a Serve replica: the model server plus its ``@serve.batch`` admission window.

Both deployments that host a model use it: ``LLMServer`` (one model per replica, reached through
handles) and ``OpenAIIngress`` when it serves its first model in its own process (no hop per token).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import ray
from ray import serve

from app.config import ServedModelConfig
from app.engine import Request
from app.server import ModelServer
from deployments.drafting import HandleDraftClient

ServerFactory = Callable[..., Any]


def resolve_factory(factory: str | ServerFactory) -> ServerFactory:
    """A factory itself, or the ``"module:attribute"`` import path of one (resolved in the replica's process)."""
    if callable(factory):
        return factory
    module_name, _, attribute = factory.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"server_factory must be 'module:attribute', got {factory!r}")
    return getattr(importlib.import_module(module_name), attribute)


def on_the_replicas_devices(config: ServedModelConfig) -> ServedModelConfig:
    """``device: auto`` runs on CUDA only where Ray gave this replica a GPU (``replica.num_gpus``): a replica that
    asked for none and took a card anyway would share it with the replicas Ray does place there."""
    if config.model.device != "auto" or not ray.is_initialized() or ray.get_gpu_ids():
        return config
    return dataclasses.replace(config, model=dataclasses.replace(config.model, device="cpu"))


def admission_wait_s(config: ServedModelConfig) -> float:
    """How long the window waits for batch-mates: ``batch_wait_timeout_s`` where a group runs as one static
    batch (``dynamic``); none in ``continuous``, whose engine merges every arrival into the running batch at
    its next step anyway (a wait there only delays the first token). Arrivals within one event-loop turn
    still form one group."""
    return config.engine.batch_wait_timeout_s if config.engine.batching == "dynamic" else 0.0


def admitted_alone(config: ServedModelConfig, num_unfinished: int) -> bool:
    """Whether a request goes to the engine at once, without the window: where it is the only one on the replica
    (``num_unfinished`` counts it) in continuous mode. In dynamic mode every request takes the window: the first of a
    burst (the others still being tokenized, not yet in the engine) would otherwise run alone, and the whole burst
    wait for its generation."""
    return admission_wait_s(config) == 0 and num_unfinished <= 1


class HostedModel:
    """One model served in this process: loads it (returns after a real warm-up generation) and admits requests.

    What it serves is injectable, as Ray Serve LLM injects ``engine_cls``: ``server_factory`` is called as
    ``factory(config, admit=...)`` and returns an object shaped like ``app.server.ModelServer``.
    Serve keeps one batch queue per decorated method in a process, so a process hosts one model at most.
    """

    def __init__(
        self, config: ServedModelConfig, server_factory: str | ServerFactory = ModelServer, draft_deployments: dict[int, str] | None = None
    ) -> None:
        """``draft_deployments``: for each of the model's ``drafter: model`` drafters (by index), the deployment
        that serves its draft model (deployments/drafting.py)."""
        config = on_the_replicas_devices(config)
        batching = config.engine.batching != "none"
        extra = {"draft_client": HandleDraftClient(draft_deployments)} if draft_deployments else {}
        self.server = resolve_factory(server_factory)(config, admit=self._admit if batching else None, **extra)
        self.config = config
        self._admit_window.set_max_batch_size(config.engine.max_batch_size)
        self._admit_window.set_batch_wait_timeout_s(admission_wait_s(config))

    async def _admit(self, request: Request) -> None:
        """Hand one request to the engine, through the batch window unless it goes alone."""
        engine = self.server.engine
        if admitted_alone(self.config, engine.num_unfinished):
            engine.add_group([request])
        else:
            await self._admit_window(request)

    # The @serve.batch window on the entry path: concurrent arrivals become one group, which the engine
    # prefills together (continuous) or runs to completion together (dynamic). Admission returns at once,
    # so one concurrent batch is enough and max_ongoing_requests (which counts streaming requests) never caps
    # a window.
    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def _admit_window(self, requests: list[Request]) -> list[None]:
        self.server.engine.add_group(requests)
        return [None] * len(requests)

    def stats(self) -> dict:
        """The engine's counters; ``healthy``: its engine runs and steps; ``ready``: warmed up (always, once
        constructed), healthy and not draining."""
        server = self.server
        return {**server.engine.stats(), "healthy": bool(getattr(server, "healthy", True)),
                "ready": bool(getattr(server, "ready", True))}

    async def drain(self, timeout_s: float) -> int:
        """Admit nothing more, let what is in flight finish within ``timeout_s``, end the rest with an error."""
        drain = getattr(self.server, "drain", None)  # an injected server may have none: Serve's own drain then
        return await drain(timeout_s) if drain is not None else 0

    def shutdown(self, timeout_s: float) -> None:
        self.server.shutdown(timeout_s=timeout_s)
