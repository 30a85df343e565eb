"""Speculative decoding inside the engine (n-gram drafts, lossless verification): a greedy request's output
is exactly the target's own, alone and inside a batch, and speculation actually happens. (That sampled
outputs follow the target's distribution is tested on the rejection sampler: tests/unit/spec.)"""

import pytest

from app.config import SpecConfig
from app.cpu.ops import unavailable_reason
from app.engine import Request, SamplingParams
from tests.model.conftest import PROMPTS, greedy, make_engine, run_engine

pytestmark = pytest.mark.model

NEW_TOKENS = 24
NGRAM = SpecConfig(drafter="ngram", num_speculative_tokens=4)


def _requests(loaded, prompts: list[str], tag: str, **params) -> list[Request]:
    return [Request(f"{tag}-{i}", loaded.tokenizer.encode(p), greedy(NEW_TOKENS, **params), loaded.eos_token_ids)
            for i, p in enumerate(prompts)]


def _run_with_logprobs(engine, requests: list[Request]) -> dict[str, list]:
    """Every request to completion together; (token, logprob) pairs per request."""
    seen = {r.request_id: [] for r in requests}
    engine.add_requests(requests)
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id] += [(lp.token_id, lp.logprob) for lp in output.logprobs or []]
    return seen


@pytest.fixture(scope="module")
def plain(loaded_fp32):
    """The target alone: each prompt's greedy tokens and logprobs without speculation, inside one batch."""
    return _run_with_logprobs(make_engine(loaded_fp32, max_model_len=512), _requests(loaded_fp32, PROMPTS, "p", logprobs=0))


def test_inside_a_batch_of_16_speculation_changes_no_token(loaded_fp32, plain):
    engine = make_engine(loaded_fp32, max_model_len=512, speculative=NGRAM)
    got = _run_with_logprobs(engine, _requests(loaded_fp32, PROMPTS, "p", logprobs=0))
    assert [[t for t, _ in got[k]] for k in plain] == [[t for t, _ in plain[k]] for k in plain]
    if unavailable_reason() is None:  # our kernels compute a position's row the same in any step: same bits
        assert got == plain
    stats = engine.stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted_tokens"] > 0  # it did speculate, and gain
    assert stats["num_steps"] < NEW_TOKENS + 2  # fewer steps than one token each would need (+ the prefill)
    assert stats["spec_mean_acceptance_length"] == pytest.approx(1 + stats["spec_num_accepted_tokens"] / stats["spec_num_drafts"])


@pytest.mark.parametrize("index", [0, 5, 12])  # prose, unicode, a repeated sentence (long n-gram matches)
def test_alone_speculation_changes_no_token(loaded_fp32, plain, index):
    engine = make_engine(loaded_fp32, max_model_len=512, speculative=NGRAM)
    [request] = _requests(loaded_fp32, [PROMPTS[index]], "p", logprobs=0)
    request.request_id = f"p-{index}"
    got = _run_with_logprobs(engine, [request])
    assert [t for t, _ in got[request.request_id]] == [t for t, _ in plain[request.request_id]]


def test_penalties_and_sampling_see_the_drafts_before_each_position(loaded_fp32):
    """Verification uses each position's own processed distribution: a repetition penalty counting the drafts
    before it, and sampling truncated to one token (top_k 1), both give exactly the plain decode's tokens."""
    prompt = loaded_fp32.tokenizer.encode(PROMPTS[12])  # a repeated sentence: long n-gram matches
    params = [greedy(16, repetition_penalty=1.3), SamplingParams(max_tokens=16, min_tokens=16, temperature=0.8, top_k=1)]

    def run(**engine_fields):
        engine = make_engine(loaded_fp32, max_model_len=512, **engine_fields)
        requests = [Request(f"r{i}", prompt, p, loaded_fp32.eos_token_ids) for i, p in enumerate(params)]
        return run_engine(engine, requests), engine.stats()

    (plain_out, _), (spec_out, stats) = run(), run(speculative=NGRAM)
    assert spec_out == plain_out
    assert stats["spec_num_drafts"] > 0


def test_a_seeded_sampled_request_is_reproducible_with_speculation(loaded_fp32):
    prompt = loaded_fp32.tokenizer.encode(PROMPTS[12])
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=11)

    def run():
        engine = make_engine(loaded_fp32, max_model_len=512, speculative=NGRAM)
        out = run_engine(engine, [Request("seeded", prompt, params, loaded_fp32.eos_token_ids)])["seeded"]
        return out, engine.stats()["spec_num_drafts"]

    (first, drafts), (second, _) = run(), run()
    assert first == second and len(first) >= 1 and drafts > 0


def test_preemption_and_stop_conditions_with_speculation(loaded_fp32):
    """A pool too small for every sequence: drafts, rejected blocks and recompute still leave the output alone."""
    prompts = [PROMPTS[12], PROMPTS[3], PROMPTS[14], PROMPTS[0]]
    expected = run_engine(make_engine(loaded_fp32, max_model_len=512), _requests(loaded_fp32, prompts, "s"))
    engine = make_engine(loaded_fp32, max_model_len=128, num_kv_blocks=9, speculative=NGRAM)  # 144 token slots for ~180 tokens
    got = run_engine(engine, _requests(loaded_fp32, prompts, "s"))
    assert got == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_drafts"] > 0
    assert stats["kv_blocks_used"] == 0
