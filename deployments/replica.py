"""The model replica: one ModelServer (weights + engine) per Ray actor.

Everything model-related lives in app/; this class only adapts it to Ray Serve's lifecycle
(constructor = load and warm up, check_health, graceful shutdown) and exposes the calls the
ingress makes through its handle.

What it serves is injectable, as Ray Serve LLM injects ``engine_cls``: ``server_factory`` is called
as ``factory(config, admit=...)`` and must return an object shaped like ``app.server.ModelServer``
(``serving``, ``engine``, ``model_card``, ``check_health``, ``shutdown``). It is the real ModelServer
unless the app's ``args`` name another (``server_factory: "module:attribute"``, see
deployments/builder.py); the serving tests plug in a fake model that way.
"""

from __future__ import annotations

import importlib
from typing import Any, AsyncIterator, Callable

from ray import serve

from app.api.protocol import ChatCompletionRequest, CompletionRequest
from app.config import ServedModelConfig
from app.engine import Request
from app.server import ModelServer

ServerFactory = Callable[..., Any]


# Defined before the deployment class: Serve pickles the class by value when it is decorated, and
# names defined after that point would be missing on the replica.
def resolve_factory(factory: str | ServerFactory) -> ServerFactory:
    """A factory itself, or the ``"module:attribute"`` import path of one (resolved in the replica's process)."""
    if callable(factory):
        return factory
    module_name, _, attribute = factory.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"server_factory must be 'module:attribute', got {factory!r}")
    return getattr(importlib.import_module(module_name), attribute)


@serve.deployment(
    health_check_period_s=10,
    health_check_timeout_s=30,
    graceful_shutdown_wait_loop_s=2,
    graceful_shutdown_timeout_s=60,
)
class LLMServer:
    def __init__(self, config: ServedModelConfig, server_factory: str | ServerFactory = ModelServer) -> None:
        # Serve sends no traffic until the constructor returns, and ModelServer only returns
        # after a real warm-up generation: a replica is ready only when the model runs.
        batching = config.engine.batching != "none"
        self._server = resolve_factory(server_factory)(config, admit=self._admit if batching else None)
        self._admit_window.set_max_batch_size(config.engine.max_batch_size)
        self._admit_window.set_batch_wait_timeout_s(config.engine.batch_wait_timeout_s)

    async def _admit(self, request: Request) -> None:
        """Hand one request to the engine, through the batch window unless it is alone."""
        engine = self._server.engine
        if engine.num_unfinished <= 1:  # only this request: nobody to wait for, so no window
            engine.add_group([request])
        else:
            await self._admit_window(request)

    # The @serve.batch window on the replica's entry path: concurrent arrivals become one group,
    # which the engine prefills together (continuous) or runs to completion together (dynamic).
    # Admission returns at once, so one concurrent batch is enough and max_ongoing_requests (which
    # counts streaming requests, the autoscaling signal) never caps a window.
    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def _admit_window(self, requests: list[Request]) -> list[None]:
        self._server.engine.add_group(requests)
        return [None] * len(requests)

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

    def model_card(self) -> dict:
        return self._server.model_card()

    def stats(self) -> dict:
        return self._server.engine.stats()

    def check_health(self) -> None:
        self._server.check_health()

    def __del__(self) -> None:
        # Serve stops routing to a replica before deleting it; let what is in flight finish.
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown(timeout_s=30)
