"""The HTTP and Python entry point: the OpenAI API, in front of (and usually hosting) the models.

It parses and validates bodies (app.api.protocol), picks the model by name and streams answers as
server-sent events. By default its replicas host the app's first model themselves (``local``), so that
model's streamed chunks go from the engine to the HTTP response with no Ray hop in between; other
models are deployments of their own, reached through their handles (deployments/routes.py). Other
Ray jobs call the same paths through the app handle: ``completions``/``chat``/``generate`` and their
``*_stream`` twins.

Failures reach callers in one shape, an APIError (app/api/errors.py): a client's mistake as it is,
a failure on our side (5xx, also mid-stream) as plain words plus the request id, with the exception
and its traceback in this deployment's log under that id.
"""

# No `from __future__ import annotations`: FastAPI must see real types (e.g. Request) when
# Serve ships this class to its replica by value.
import asyncio
import logging
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from fastapi.responses import JSONResponse, PlainTextResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from app.api import response_stream, responses
from app.api.errors import APIError, to_api_error
from app.api.protocol import ChatCompletionRequest, CompletionRequest
from app.api.token_requests import DetokenizeRequest, GenerateRequest, TokenizeRequest
from app.config import ServedModelConfig
from app.engine.errors import EngineOverloadedError
from app.metrics import render
from app.server import ModelServer
from app.spec.remote import DraftCall, DraftResult
from deployments.admission import HostedModel, ServerFactory
from deployments.autoscaling import engine_queue_depth
from deployments.http_answers import (RETRY_AFTER_S, as_generate_chunks, guarded, json_answer, parsed, raises_api_errors,
                                      request_id_of, sse_response, streams_api_errors, too_large)
from deployments.lifecycle import GracefulShutdown, ingress_admission_after_stop_s
from deployments.ray_metrics import RAY_METRICS_INTERVAL_S, RayMetricsExporter
from deployments.replica import MODEL_REPLICA_OPTIONS
from deployments.routes import LocalModel, Relayed, RemoteModel

logger = logging.getLogger(__name__)

api = FastAPI(title="llm-serve", description="OpenAI-compatible LLM serving on Ray Serve")

_PROBE_TIMEOUT_S = 10
_METRICS_TIMEOUT_S = 5  # within Prometheus' default scrape timeout (10 s): the others' figures still arrive
_READY_TIMEOUT_S = 5  # a readiness probe answers within this (Kubernetes: timeoutSeconds above it)
# A model's card, the first time it is asked for: a deployment with no replica (starting, or being replaced after a
# crash) would hold the call until one comes up; Serve's router waits that long
_CARD_TIMEOUT_S = 5


# Helpers come before the deployment class: Serve pickles the class by value when it is decorated,
# and names defined after that point would be missing on the replica.
@api.exception_handler(HTTPException)
async def _no_such_route(raw: Request, exc: HTTPException) -> JSONResponse:
    """A path or method the server has not: an OpenAI-style error (FastAPI's own is ``{"detail": ...}``)."""
    hint = exc.status_code == 404 and not raw.url.path.startswith("/v1/")
    message = f"{raw.method} {raw.url.path}: {exc.detail}" + (" (the OpenAI API is under /v1)" if hint else "")
    if raw.url.path.startswith("/v1/responses/"):  # a stored response's retrieval, cancel or input items
        message += " (this server keeps no responses: each one is answered whole, or streamed, when it is created)"
    return JSONResponse(APIError(exc.status_code, message).to_dict(), status_code=exc.status_code, headers=exc.headers)


_ENGINE_STOPPED = "its engine stopped (died or wedged): Serve replaces the replica"


def _probe_failure(model: str, exc: BaseException) -> str:
    """Why a model's deployment failed its health probe, in plain words; the details go to the log."""
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer within {_PROBE_TIMEOUT_S} s"
    logger.error("health probe of %s failed", model, exc_info=exc)
    return to_api_error(exc).message


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000, **MODEL_REPLICA_OPTIONS)
@serve.ingress(api)
class OpenAIIngress:
    def __init__(
        self,
        servers: list[DeploymentHandle],
        model_names: list[str],
        max_request_bytes: int,
        local: ServedModelConfig | None = None,
        server_factory: str | ServerFactory = ModelServer,
        draft_deployments: dict[int, str] | None = None,
    ) -> None:
        """``servers``: handles of the models served elsewhere, named by ``model_names`` (a handle appears once
        per name its model answers to); ``local``: the model
        this replica hosts itself (the app's first), loaded and warmed up before the replica takes traffic."""
        self._hosted = HostedModel(local, server_factory, draft_deployments) if local is not None else None
        self._relayed = Relayed()  # calls in flight at the other models' deployments
        self._routes = {name: RemoteModel(server, self._relayed) for name, server in zip(model_names, servers)}
        if self._hosted is not None:  # a model's speculative twin is the same model under a second name
            hosted = LocalModel(self._hosted)
            self._routes = {**{name: hosted for name in local.served_names}, **self._routes}
            # this replica's own model, through Ray's metrics agent too (docs/metrics.md)
            self._ray_metrics = asyncio.get_running_loop().create_task(
                RayMetricsExporter().run_periodically(hosted.metrics, interval_s=RAY_METRICS_INTERVAL_S))
        self._default_model = next(iter(self._routes))
        self._max_request_bytes = max_request_bytes
        self._draining = False
        # Serve's stop of this replica, seen as it begins (deployments/lifecycle.py): drain before the kill.
        self._shutdown = GracefulShutdown(
            self._drain, MODEL_REPLICA_OPTIONS["graceful_shutdown_timeout_s"], MODEL_REPLICA_OPTIONS["graceful_shutdown_wait_loop_s"],
            admit_after_stop_s=ingress_admission_after_stop_s())

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook (autoscaled deployments): the hosted model's queue depth, for deployments/autoscaling.py
        (a router reports nothing: Serve's ongoing requests decide)."""
        return engine_queue_depth(self._hosted.stats()) if self._hosted is not None else {}

    def check_health(self) -> None:
        """Serve replaces this replica when the model it hosts can no longer serve (its engine died or is wedged)."""
        if self._hosted is not None:
            self._hosted.server.check_health()

    async def _drain(self, budget_s: float) -> None:
        """Admit nothing more (503 + Retry-After), let requests in flight finish within ``budget_s``, then end
        the rest with an explicit error: the hosted model's in its engine, relayed ones by cancelling them."""
        self._draining = True
        deadline = time.monotonic() + budget_s

        async def relayed() -> int:
            while len(self._relayed) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return self._relayed.cut_all()

        ended = await asyncio.gather(relayed(), *([self._hosted.drain(budget_s)] if self._hosted is not None else []))
        if sum(ended):
            logger.warning("drain window over: ended %d request(s) still running", sum(ended))

    async def __del__(self) -> None:
        """Serve's only shutdown hook, called (and awaited) after its own drain: finish ours, then release the engine."""
        shutdown = getattr(self, "_shutdown", None)
        if shutdown is not None:
            shutdown.cancel()
            await shutdown.run()
        hosted = getattr(self, "_hosted", None)
        if hosted is not None:
            await asyncio.to_thread(hosted.shutdown, 0)

    # ---- HTTP ---------------------------------------------------------------------------
    @api.post("/v1/completions")
    async def http_completions(self, raw: Request):
        request_id = request_id_of(raw)
        return await guarded(self._respond(raw, CompletionRequest, "completion", request_id), request_id)

    @api.post("/v1/chat/completions")
    async def http_chat(self, raw: Request):
        request_id = request_id_of(raw)
        return await guarded(self._respond(raw, ChatCompletionRequest, "chat", request_id), request_id)

    @api.post("/v1/responses")
    async def http_responses(self, raw: Request):
        request_id = request_id_of(raw)
        return await guarded(self._respond_responses(raw, request_id), request_id)

    @api.post("/tokenize")
    async def http_tokenize(self, raw: Request):
        request_id = request_id_of(raw)
        return await guarded(self._respond_plain(raw, TokenizeRequest, "tokenize"), request_id)

    @api.post("/detokenize")
    async def http_detokenize(self, raw: Request):
        request_id = request_id_of(raw)
        return await guarded(self._respond_plain(raw, DetokenizeRequest, "detokenize"), request_id)

    @api.post("/v1/generate")
    async def http_generate(self, raw: Request):
        request_id = request_id_of(raw)
        return await guarded(self._respond_generate(raw, request_id), request_id)

    @api.get("/v1/models")
    async def http_models(self):
        return await guarded(self._models(), request_id_of())

    @api.get("/v1/models/{model:path}")
    async def http_model(self, model: str):
        return await guarded(self._model_card(model), request_id_of())

    @api.get("/metrics")
    async def http_metrics(self):
        """Prometheus text: every model's latency histograms, request and token counters, engine gauges."""
        return await guarded(self._metrics(), request_id_of())

    @api.get("/health")
    async def http_health(self):
        """200 when every model deployment answers and its engine runs; 503 naming the ones that do not."""
        probes = [asyncio.wait_for(route.stats(), timeout=_PROBE_TIMEOUT_S) for route in self._routes.values()]
        results = await asyncio.gather(*probes, return_exceptions=True)
        failing = {name: _probe_failure(name, r) if isinstance(r, BaseException) else _ENGINE_STOPPED
                   for name, r in zip(self._routes, results) if isinstance(r, BaseException) or not r.get("healthy", True)}
        if failing:
            return JSONResponse({"status": "unavailable", "failing": failing}, status_code=503)
        return {"status": "ok", "models": dict(zip(self._routes, results))}

    @api.get("/health/ready")
    async def http_ready(self):
        """Readiness: 200 once every model answers and reports itself ready (warmed up by a real generation,
        engine healthy, not draining); 503 naming the ones that are not, and while this replica drains."""
        if self._draining or self._shutdown.started:  # stopped: still serving what routers sent, taking no more
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        probes = [asyncio.wait_for(route.stats(), timeout=_READY_TIMEOUT_S) for route in self._routes.values()]
        results = await asyncio.gather(*probes, return_exceptions=True)
        waiting = {}
        for name, result in zip(self._routes, results):
            if isinstance(result, asyncio.TimeoutError):
                waiting[name] = f"no answer within {_READY_TIMEOUT_S} s"
            elif isinstance(result, BaseException):
                waiting[name] = _probe_failure(name, result)
            elif not result.get("ready"):
                waiting[name] = "not ready (draining, or its engine stopped)"
        if waiting:
            return JSONResponse({"status": "not_ready", "waiting": waiting}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"status": "ready", "models": list(self._routes)}

    # ---- Python handle API ----------------------------------------------------------------
    @raises_api_errors
    async def completions(self, body: dict | str | bytes) -> dict:
        return await self._call(await parsed(body, CompletionRequest, stream=False), "completion")

    @streams_api_errors
    async def completions_stream(self, body: dict | str | bytes) -> AsyncIterator[dict]:
        async for chunk in self._stream(await parsed(body, CompletionRequest, stream=True), "completion"):
            yield chunk

    @raises_api_errors
    async def chat(self, body: dict | str | bytes) -> dict:
        return await self._call(await parsed(body, ChatCompletionRequest, stream=False), "chat")

    @streams_api_errors
    async def chat_stream(self, body: dict | str | bytes) -> AsyncIterator[dict]:
        async for chunk in self._stream(await parsed(body, ChatCompletionRequest, stream=True), "chat"):
            yield chunk

    @raises_api_errors
    async def generate(self, body: dict | str | bytes) -> dict:
        return await self._generate(await parsed(body, GenerateRequest, stream=False))

    @streams_api_errors
    async def generate_stream(self, body: dict | str | bytes) -> AsyncIterator[dict]:
        request = await parsed(body, GenerateRequest, stream=True)
        async for chunk in as_generate_chunks(self._stream(request.to_completion(), "completion")):
            yield chunk

    async def propose(self, call: DraftCall) -> DraftResult:
        """Draft for another model's sequence, with the model this replica hosts (app/spec/remote.py)."""
        if self._hosted is None:
            raise LookupError("this ingress hosts no model to draft with")
        return await self._hosted.server.propose(call)

    @raises_api_errors
    async def model_stats(self, model: str | None = None) -> dict:
        """The engine counters of ``model`` (default: the first), wherever it runs: requests, KV blocks, steps."""
        try:
            return await asyncio.wait_for(self._route_for(model, a_request=False).stats(), timeout=_PROBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise EngineOverloadedError(f"the model {model or self._default_model!r} has no replica answering within "
                                        f"{_PROBE_TIMEOUT_S} s (starting, or being replaced); retry") from None

    # ---- internals (the HTTP routes' work too) ------------------------------------------
    async def _generate(self, request: GenerateRequest) -> dict:
        result = await self._call(request.to_completion(), "completion")
        choice = result["choices"][0]
        return {"model": result["model"], "text": choice["text"], "finish_reason": choice["finish_reason"], "usage": result["usage"]}

    async def _metrics(self) -> PlainTextResponse:
        names = {id(route): name for name, route in reversed(list(self._routes.items()))}  # a twin shares its model's
        routes = list({id(route): route for route in self._routes.values()}.values())
        gathered = await asyncio.gather(*(asyncio.wait_for(route.metrics(), timeout=_METRICS_TIMEOUT_S) for route in routes),
                                        return_exceptions=True)
        by_model = {}
        for route, result in zip(routes, gathered):
            if isinstance(result, BaseException):  # the others' figures still go out; its series go stale
                logger.warning("metrics of %s unavailable: %s: %s", names[id(route)], type(result).__name__, result)
                continue
            by_model.update(result)
        return PlainTextResponse(render(by_model), media_type="text/plain; version=0.0.4")

    async def _models(self) -> dict:
        """Every model whose card is known or comes within ``_CARD_TIMEOUT_S``; one that has not answered yet (no
        replica up) is left out, with a warning, rather than hold the list."""
        cards = await asyncio.gather(*(self._model_card(name) for name in self._routes), return_exceptions=True)
        for name, card in zip(self._routes, cards):
            if isinstance(card, BaseException):
                logger.warning("/v1/models leaves %s out: %s", name, card)
        return {"object": "list", "data": [card for card in cards if not isinstance(card, BaseException)]}

    async def _model_card(self, name: str) -> dict:
        try:
            return await asyncio.wait_for(self._served(name).model_card(name), timeout=_CARD_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise EngineOverloadedError(f"the model {name!r} has no replica answering yet (starting, or being "
                                        f"replaced); retry") from None

    def _route_for(self, model: str | None, a_request: bool = True):
        """Where ``model`` is served; while this replica drains, a 503 (a request's: counted as the hosted model's
        refusal, as its own would be)."""
        route = self._served(model or self._default_model)
        if self._draining:  # Serve is stopping this replica: the client retries and reaches another one
            serving = getattr(self._hosted.server, "serving", None) if isinstance(route, LocalModel) else None
            if a_request and serving is not None:  # (an injected server may keep no figures)
                serving.metrics_for(model or self._default_model).record_rejection("draining")
            raise EngineOverloadedError("this server is shutting down; retry")
        return route

    def _served(self, name: str):
        route = self._routes.get(name)
        if route is None:
            served = ", ".join(self._routes)
            raise APIError(404, f"The model {name!r} does not exist; this server serves: {served}", param="model", code="model_not_found")
        return route

    async def _call(self, request, kind: str) -> dict:
        return await self._route_for(request.model).call(kind, request)

    def _stream(self, request, kind: str) -> AsyncIterator[dict]:
        return self._route_for(request.model).stream(kind, request)

    async def _respond(self, raw: Request, request_cls: type, kind: str, request_id: str):
        request = await parsed(await self._read_body(raw), request_cls)
        if request.stream:
            return await sse_response(self._stream(request, kind), request_id)
        return await json_answer(await self._call(request, kind))

    async def _respond_plain(self, raw: Request, request_cls: type, kind: str):
        """A request answered in one piece by the model it names (vLLM's /tokenize, /detokenize)."""
        return JSONResponse(await self._call(await parsed(await self._read_body(raw), request_cls), kind))

    async def _respond_responses(self, raw: Request, request_id: str):
        """The Responses API over the chat path (app/api/responses.py)."""
        body, request = await asyncio.to_thread(responses.parse_request, await self._read_body(raw))
        response_id, created = responses.new_ids(body)
        chunks = self._stream(request, "chat")  # streamed either way: the whole response is read from the stream
        if body.get("stream"):
            events = response_stream.response_events(body, chunks, response_id, created, request_id)
            return await sse_response(events, request_id, named=True)
        return JSONResponse(await response_stream.whole_response(body, chunks, response_id, created))

    async def _respond_generate(self, raw: Request, request_id: str):
        request = await parsed(await self._read_body(raw), GenerateRequest)
        if request.stream:
            chunks = self._stream(request.to_completion(), "completion")
            return await sse_response(as_generate_chunks(chunks), request_id)
        return JSONResponse(await self._generate(request))

    async def _read_body(self, raw: Request) -> bytes:
        declared = raw.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_request_bytes:
            raise too_large(self._max_request_bytes)
        body = bytearray()  # grown in place: bytes would be copied whole for every part
        async for part in raw.stream():
            body += part
            if len(body) > self._max_request_bytes:
                raise too_large(self._max_request_bytes)
        return bytes(body)

