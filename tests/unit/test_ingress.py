"""The ingress's own work (deployments/ingress.py): GET /metrics gathers every model's figures, one model that does
not answer leaving the others' out there (not a 500 for the whole scrape), as /v1/models does; requests are parsed off
the event loop, a handle call's body given as a dict or as JSON text."""

from __future__ import annotations

import asyncio
import types

import pytest

from app.engine.errors import EngineOverloadedError
from deployments.ingress import OpenAIIngress


class _Answers:
    async def metrics(self):
        return {"good": {"requests": {}, "engine": {"num_running": 3}}}


class _Down:
    async def metrics(self):
        raise RuntimeError("replica unavailable (ActorDiedError)")


async def test_a_model_that_does_not_answer_leaves_the_others_figures():
    ingress = types.SimpleNamespace(_routes={"good": _Answers(), "down": _Down()})
    response = await OpenAIIngress.func_or_class._metrics(ingress)
    assert response.status_code == 200
    assert 'llm_serve:num_requests_running{model_name="good"} 3.0' in response.body.decode()


async def test_a_request_is_parsed_off_the_event_loop_while_the_loop_goes_on():
    """A large schema's grammar compiles while its request is parsed: the loop (the hosted model's streams) is not
    held meanwhile. The parse is held here until a task on the loop has run."""
    import asyncio
    import threading

    from app.api import protocol
    from app.api.protocol import ChatCompletionRequest
    from deployments import http_answers

    loop_ran = threading.Event()
    parse = protocol.parse_body

    def slow_parse(body, cls):
        assert loop_ran.wait(5), "the event loop was held while parsing"
        return parse(body, cls)

    async def on_the_loop():
        loop_ran.set()

    original, http_answers.parse_body = http_answers.parse_body, slow_parse
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"choice": ["a", "b"]}}
        request, _ = await asyncio.gather(http_answers.parsed(body, ChatCompletionRequest), on_the_loop())
    finally:
        http_answers.parse_body = original
    assert request.grammar() is not None


class _Card:
    async def model_card(self, name):
        return {"id": name, "object": "model"}


class _NoReplica:
    async def model_card(self, name):
        await asyncio.sleep(3600)  # Serve's router waits for a replica this long


async def test_models_list_every_model_that_answers_and_does_not_wait_on_one_with_no_replica(monkeypatch):
    # the methods' own globals: Serve's ingress decorator rebuilds the class's functions over a copy of the module's
    monkeypatch.setitem(OpenAIIngress.func_or_class._model_card.__globals__, "_CARD_TIMEOUT_S", 0.05)
    ingress = types.SimpleNamespace(_routes={"up": _Card(), "starting": _NoReplica()})
    ingress._served = ingress._routes.__getitem__
    ingress._model_card = lambda name: OpenAIIngress.func_or_class._model_card(ingress, name)
    listed = await asyncio.wait_for(OpenAIIngress.func_or_class._models(ingress), timeout=5)
    assert listed == {"object": "list", "data": [{"id": "up", "object": "model"}]}
    with pytest.raises(EngineOverloadedError, match="retry"):  # /v1/models/starting: a 503 telling to retry
        await ingress._model_card("starting")


@pytest.mark.parametrize("body", ['{"prompt": "hi"}', b'{"prompt": "hi", "stream": true}', {"prompt": "hi"}])
async def test_a_handle_call_takes_its_body_as_a_dict_or_json_text_and_its_methods_stream_setting(body):
    from app.api.protocol import CompletionRequest
    from deployments.http_answers import parsed

    for stream in (False, True):
        request = await parsed(body, CompletionRequest, stream=stream)
        assert (request.prompt, request.stream) == ("hi", stream)


@pytest.mark.parametrize("body", [["hi"], 5, '["hi"]'])
async def test_a_handle_call_with_a_body_that_is_no_json_object_is_a_400(body):
    from app.api.errors import APIError
    from app.api.protocol import CompletionRequest
    from deployments.http_answers import parsed

    with pytest.raises(APIError) as refused:
        await parsed(body, CompletionRequest, stream=False)
    assert refused.value.status == 400 and "JSON object" in refused.value.message


class _Stats:
    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour

    async def stats(self):
        if self.behaviour == "fails":
            raise RuntimeError("ActorDiedError at /secret/path/replica.py")
        await asyncio.sleep(60)  # no replica answering


@pytest.mark.parametrize("behaviour, status", [("fails", 500), ("hangs", 503)])
async def test_model_stats_answers_a_handle_caller_as_the_other_methods_do(monkeypatch, behaviour, status):
    """A failing model is the plain APIError an HTTP client would read (no internals), and one with no replica
    answering a 503 within the probe's bound, not a call that never returns."""
    from app.api.errors import APIError
    from deployments import ingress as ingress_module

    monkeypatch.setattr(ingress_module, "_PROBE_TIMEOUT_S", 0.05)
    ingress = types.SimpleNamespace(_route_for=lambda model, a_request: _Stats(behaviour), _default_model="m")
    with pytest.raises(APIError) as raised:
        await OpenAIIngress.func_or_class.model_stats(ingress, model="m")  # as a keyword too
    assert raised.value.status == status and "/secret" not in raised.value.message


def test_a_draining_ingress_counts_its_refusal_of_the_hosted_model_as_that_models_rejection():
    """The hosted model's requests refused at the ingress while it drains are 503s its clients read: they appear in
    its request_rejected_total{reason="draining"}, as a model replica's own refusals do."""
    from app.api.errors import APIError
    from app.api.serving import OpenAIServing
    from deployments.routes import LocalModel

    from app.metrics import RequestMetrics

    serving = types.SimpleNamespace(metrics={"m": RequestMetrics()}, speculative_names=[], model_name="m")  # as made
    serving.metrics_for = types.MethodType(OpenAIServing.metrics_for, serving)
    hosted = types.SimpleNamespace(server=types.SimpleNamespace(serving=serving))
    ingress = types.SimpleNamespace(_draining=True, _hosted=hosted, _default_model="m",
                                    _routes={"m": LocalModel(hosted), "other": object()})
    ingress._served = types.MethodType(OpenAIIngress.func_or_class._served, ingress)
    for model in ("m", None, "other"):
        with pytest.raises(EngineOverloadedError):
            OpenAIIngress.func_or_class._route_for(ingress, model)
    ingress._route_for = types.MethodType(OpenAIIngress.func_or_class._route_for, ingress)
    with pytest.raises(APIError) as raised:  # a stats probe while draining: a 503, and no request refused
        asyncio.run(OpenAIIngress.func_or_class.model_stats(ingress, "m"))
    assert raised.value.status == 503
    assert {name: m.rejected["draining"] for name, m in serving.metrics.items()} == {"m": 2}  # the other's: its own
