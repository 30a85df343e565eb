"""The speculative twins of the GPTQ model over HTTP: the same engine drafting by prompt lookup (-ngram), or
verifying what the embedded model drafts on the ingress's replica (-spec), answers every greedy request exactly
as the model without speculation, alone and inside a batch (where our CPU kernels run; elsewhere up to a
near-tie). (Every one of the 16 prompts, alone and batched, is the model tier's test, tests/model/test_speculative.py:
here the path across replicas and HTTP.)"""

import asyncio

import httpx
import pytest
from ray import serve

from tests.prompts import PROMPTS
from tests.serve.conftest import BASE, GPTQ_MODEL, GPTQ_NGRAM_MODEL, GPTQ_SPEC_MODEL

pytestmark = pytest.mark.serve

MAX_TOKENS = 16
# Prose, a list, a chat template and a repeated sentence (long n-gram matches).
BATCH = [PROMPTS[i] for i in (0, 3, 9, 12)]
ALONE = [PROMPTS[i] for i in (2, 12)]


NEAR_TIE_NATS = 0.05


def _body(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 2}


async def _complete_all(model: str, prompts: list[str]) -> list[dict]:
    async with httpx.AsyncClient(base_url=BASE, timeout=120) as http:
        responses = await asyncio.gather(*(http.post("/v1/completions", json=_body(model, p)) for p in prompts))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    return [r.json() for r in responses]


def _our_kernels_run() -> bool:
    """Asked only where two answers differ: the question imports torch, which this process otherwise never loads
    (``serve.run`` and ``serve.status`` pickle with cloudpickle, which scans every loaded module each time)."""
    from app.cpu.ops import unavailable_reason

    return unavailable_reason() is None


def _assert_answers_as_the_model(speculative: dict, plain: dict) -> None:
    """The same greedy tokens, where our kernels run (engine.batch_invariant: a row's bits do not depend on its step).
    Where they cannot, torch's products sum a verification step's rows in another order than a decode step's, so the
    two may part at a near-tie: at the first token they differ on, the model's top two were within NEAR_TIE_NATS."""
    ours, theirs = speculative["choices"][0]["logprobs"], plain["choices"][0]["logprobs"]
    if ours["tokens"] == theirs["tokens"] or _our_kernels_run():
        assert speculative["choices"][0]["text"] == plain["choices"][0]["text"]
        return
    part = next(i for i, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"])) if a != b)
    top = theirs["top_logprobs"][part]
    assert ours["tokens"][part] in top, (part, ours["tokens"][part], top)
    assert top[theirs["tokens"][part]] - top[ours["tokens"][part]] < NEAR_TIE_NATS, (part, top)


@pytest.fixture(scope="module")
def plain_answers(serve_app) -> dict[str, dict]:
    prompts = list(dict.fromkeys(BATCH + ALONE))
    return dict(zip(prompts, asyncio.run(_complete_all(GPTQ_MODEL, prompts))))


@pytest.mark.parametrize("twin", [GPTQ_NGRAM_MODEL, GPTQ_SPEC_MODEL])
def test_inside_a_batch_the_twin_answers_as_the_model_does(serve_app, plain_answers, twin):
    handle = serve.get_app_handle("default")
    before = handle.model_stats.remote(GPTQ_MODEL).result()["spec_by_name"][twin]
    speculative = asyncio.run(_complete_all(twin, BATCH))
    after = handle.model_stats.remote(GPTQ_MODEL).result()["spec_by_name"][twin]
    plain = [plain_answers[prompt] for prompt in BATCH]
    for twin_answer, answer in zip(speculative, plain):
        _assert_answers_as_the_model(twin_answer, answer)
    assert {a["model"] for a in speculative} == {twin} and {a["model"] for a in plain} == {GPTQ_MODEL}
    assert all(a["usage"]["completion_tokens"] == MAX_TOKENS for a in speculative)
    assert after["num_drafts"] - before["num_drafts"] >= len(BATCH)  # the twin drafted; the plain name never does
    assert after["num_accepted_tokens"] > before["num_accepted_tokens"]


@pytest.mark.parametrize("twin", [GPTQ_NGRAM_MODEL, GPTQ_SPEC_MODEL])
def test_alone_the_twin_answers_as_the_model_does(serve_app, plain_answers, twin):
    for prompt in ALONE:
        [speculative] = asyncio.run(_complete_all(twin, [prompt]))
        _assert_answers_as_the_model(speculative, plain_answers[prompt])


def test_sampled_requests_are_verified_against_what_the_draft_replica_sampled_from(serve_app):
    """At temperature 1 the draft (the embedded model) and the target (its GPTQ build) mostly agree in
    distribution: verified against the q each draft was drawn from, a first draft passes with about the mass
    they share (one-hot drafts would pass with p(x), about half as often: tests/model/test_speculative.py).
    One stream at a time: inside a batch this machine's draft replica answers slower than a sequence waits. Six
    of them (~30 first drafts): the kept share is a count of random draws, and the bound sits below what verified
    drafts keep on a loaded machine, above what one-hot ones would."""
    handle = serve.get_app_handle("default")
    before = handle.model_stats.remote(GPTQ_MODEL).result()["spec_by_name"][GPTQ_SPEC_MODEL]
    body = {"model": GPTQ_SPEC_MODEL, "max_tokens": MAX_TOKENS, "temperature": 1.0, "ignore_eos": True}
    with httpx.Client(base_url=BASE, timeout=120) as http:
        for prompt in PROMPTS[:6]:
            response = http.post("/v1/completions", json={**body, "prompt": prompt})
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == MAX_TOKENS
    after = handle.model_stats.remote(GPTQ_MODEL).result()["spec_by_name"][GPTQ_SPEC_MODEL]
    drafts = after["num_drafts"] - before["num_drafts"]
    first_kept = after["num_accepted_tokens_per_pos"][0] - before["num_accepted_tokens_per_pos"][0]
    assert drafts >= 16 and first_kept / drafts > 0.55, (drafts, first_kept)


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
