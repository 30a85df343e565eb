"""A model replica reached through its handle: one hosted model (weights + engine) per Ray actor.

Everything model-related lives in app/; this class only adapts it to Ray Serve's lifecycle
(constructor = load and warm up, check_health, graceful shutdown) and exposes the calls the
ingress makes through its handle. The app's first model is usually hosted by the ingress itself
(deployments/builder.py): this deployment serves the others, each scaled on its own.

What it serves is injectable (``server_factory``, see deployments/admission.py); the serving tests
plug in a fake model that way.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from ray import serve

from app.api.protocol import ChatCompletionRequest, CompletionRequest
from app.api.token_requests import DetokenizeRequest, TokenizeRequest
from app.config import ServedModelConfig
from app.server import ModelServer
from app.spec.remote import DraftCall, DraftResult
from deployments.admission import HostedModel, ServerFactory
from deployments.autoscaling import engine_queue_depth
from deployments.lifecycle import GracefulShutdown
from deployments.ray_metrics import RAY_METRICS_INTERVAL_S, RayMetricsExporter

# What a model-hosting replica tells Serve: health probes and a drain window for requests in flight.
MODEL_REPLICA_OPTIONS = dict(
    health_check_period_s=10,
    health_check_timeout_s=30,
    graceful_shutdown_wait_loop_s=2,
    graceful_shutdown_timeout_s=60,
)


@serve.deployment(**MODEL_REPLICA_OPTIONS)
class LLMServer:
    def __init__(
        self, config: ServedModelConfig, server_factory: str | ServerFactory = ModelServer, draft_deployments: dict[int, str] | None = None
    ) -> None:
        # Serve sends no traffic until the constructor returns, and the model server only returns
        # after a real warm-up generation: a replica is ready only when the model runs.
        self._model = HostedModel(config, server_factory, draft_deployments)
        self._server = self._model.server
        # this replica's model, through Ray's metrics agent too (docs/metrics.md)
        self._ray_metrics = asyncio.get_running_loop().create_task(
            RayMetricsExporter().run_periodically(self._server.metrics, interval_s=RAY_METRICS_INTERVAL_S))
        # Serve's stop of this replica, seen as it begins (deployments/lifecycle.py): drain before the kill.
        self._shutdown = GracefulShutdown(self._model.drain, MODEL_REPLICA_OPTIONS["graceful_shutdown_timeout_s"],
                                          MODEL_REPLICA_OPTIONS["graceful_shutdown_wait_loop_s"])

    async def completion(self, request: CompletionRequest) -> dict:
        return await self._server.serving.completion(request)

    async def completion_stream(self, request: CompletionRequest) -> AsyncIterator[dict]:
        async for chunk in self._server.serving.completion_stream(request):
            yield chunk

    async def chat(self, request: ChatCompletionRequest) -> dict:
        return await self._server.serving.chat(request)

    async def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[dict]:
        async for chunk in self._server.serving.chat_stream(request):
            yield chunk

    async def tokenize(self, request: TokenizeRequest) -> dict:
        return await self._server.serving.tokenize(request)

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        return await self._server.serving.detokenize(request)

    async def propose(self, call: DraftCall) -> DraftResult:
        """Draft for a sequence of a model that uses this one as its draft model (app/spec/remote.py)."""
        return await self._server.propose(call)

    def model_card(self, name: str | None = None) -> dict:
        return self._server.model_card(name)

    def stats(self) -> dict:
        return self._model.stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook (autoscaled deployments): this replica's queue depth, for deployments/autoscaling.py."""
        return engine_queue_depth(self._model.stats())

    def metrics(self) -> dict[str, dict]:
        return self._server.metrics()

    def check_health(self) -> None:
        self._server.check_health()

    async def __del__(self) -> None:
        """Serve's only shutdown hook, called (and awaited) after its own drain: finish ours, then release the engine."""
        shutdown = getattr(self, "_shutdown", None)
        if shutdown is not None:
            shutdown.cancel()
            await shutdown.run()
        model = getattr(self, "_model", None)
        if model is not None:
            await asyncio.to_thread(model.shutdown, 0)
