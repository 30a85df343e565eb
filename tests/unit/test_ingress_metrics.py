"""The ingress's own work (deployments/ingress.py): GET /metrics gathers every model's figures, one model that does
not answer leaving the others' out there (not a 500 for the whole scrape); requests are parsed off the event loop."""

from __future__ import annotations

import types

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
