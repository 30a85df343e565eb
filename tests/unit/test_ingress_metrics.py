"""GET /metrics gathers every model's figures (deployments/ingress.py): one model that does not answer leaves
the others' figures out there, not a 500 for the whole scrape."""

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
