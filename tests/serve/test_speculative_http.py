"""The speculative twin of the GPTQ model over HTTP: the same engine drafting by prompt lookup answers
every greedy request exactly as the model without speculation, alone and inside a batch of 16."""

import asyncio

import httpx
import pytest
from ray import serve

from tests.model.conftest import PROMPTS
from tests.serve.conftest import BASE, GPTQ_MODEL, GPTQ_NGRAM_MODEL

pytestmark = pytest.mark.serve

MAX_TOKENS = 24


def _body(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


async def _complete_all(model: str, prompts: list[str]) -> list[dict]:
    async with httpx.AsyncClient(base_url=BASE, timeout=120) as http:
        responses = await asyncio.gather(*(http.post("/v1/completions", json=_body(model, p)) for p in prompts))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    return [r.json() for r in responses]


def _texts(answers: list[dict]) -> list[str]:
    return [a["choices"][0]["text"] for a in answers]


def test_inside_a_batch_of_16_the_twin_answers_as_the_model_does(serve_app):
    plain = asyncio.run(_complete_all(GPTQ_MODEL, PROMPTS))
    before = serve.get_app_handle("default").model_stats.remote(GPTQ_MODEL).result()
    speculative = asyncio.run(_complete_all(GPTQ_NGRAM_MODEL, PROMPTS))
    after = serve.get_app_handle("default").model_stats.remote(GPTQ_NGRAM_MODEL).result()
    assert _texts(speculative) == _texts(plain)
    assert {a["model"] for a in speculative} == {GPTQ_NGRAM_MODEL} and {a["model"] for a in plain} == {GPTQ_MODEL}
    assert all(a["usage"]["completion_tokens"] == MAX_TOKENS for a in speculative)
    assert after["spec_num_drafts"] > before["spec_num_drafts"]  # the twin drafted; the plain name never does
    assert after["spec_num_accepted_tokens"] > before["spec_num_accepted_tokens"]


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[12]])
def test_alone_the_twin_answers_as_the_model_does(serve_app, prompt):
    [plain] = asyncio.run(_complete_all(GPTQ_MODEL, [prompt]))
    [speculative] = asyncio.run(_complete_all(GPTQ_NGRAM_MODEL, [prompt]))
    assert speculative["choices"][0]["text"] == plain["choices"][0]["text"]


def test_the_plain_name_is_never_drafted_for(serve_app):
    handle = serve.get_app_handle("default")
    before = handle.model_stats.remote(GPTQ_MODEL).result()["spec_num_drafts"]
    asyncio.run(_complete_all(GPTQ_MODEL, [PROMPTS[12]] * 2))
    assert handle.model_stats.remote(GPTQ_MODEL).result()["spec_num_drafts"] == before


def test_metrics_show_the_engine_and_its_speculation(serve_app, client):
    asyncio.run(_complete_all(GPTQ_NGRAM_MODEL, [PROMPTS[12]]))
    text = client.get("/metrics").text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    label = f'{{model_name="{GPTQ_MODEL}"}}'
    assert float(samples[f'llm_serve:spec_decode_num_drafts_total{{model_name="{GPTQ_NGRAM_MODEL}"}}']) > 0  # by drafter
    assert float(samples[f"llm_serve:iteration_tokens_total_count{label}"]) > 0
    assert 0 <= float(samples[f"llm_serve:kv_cache_usage_perc{label}"]) <= 1
    assert float(samples[f'llm_serve:request_success_total{{model_name="{GPTQ_NGRAM_MODEL}",finished_reason="length"}}']) >= 1
    for phase in ("queue", "prefill", "decode"):  # the engine's phases, reported with each finished request
        assert float(samples[f'llm_serve:request_{phase}_time_seconds_count{{model_name="{GPTQ_NGRAM_MODEL}"}}']) >= 1
