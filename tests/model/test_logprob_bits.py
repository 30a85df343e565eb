"""A request's logprobs, bit for bit, whatever the engine did around it (real model, fp32, CPU kernels).

Greedy tokens are compared elsewhere; these compare every logprob and top alternative exactly. They
hold because every part of a step computes a token's row on its own (our GEMM, norm and RoPE kernels)
and attention computes every query, prefill or decode, with the one function of the CPU kernel.
"""

import pytest

from app.cpu.ops import unavailable_reason
from app.engine import Request, SamplingParams
from tests.model.conftest import make_engine

# torch's CPU kernels give no such guarantee (SDPA's result for a query varies in the last bits with how
# many queries and keys share the call), so on a CPU where ours cannot run there is nothing to check.
pytestmark = [
    pytest.mark.model,
    pytest.mark.cpu_only,
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"bit-exact logprobs come from our CPU kernels, which cannot run here: {unavailable_reason()}"),
]

NEW_TOKENS = 6


def _sampling(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0, logprobs=3)


def _logprobs(engine, prompts: dict[str, list[int]], eos, tokens: int = NEW_TOKENS) -> dict[str, list[tuple]]:
    """Run ``prompts`` to completion together; each request's (token, logprob, top alternatives) per token."""
    requests = [Request(rid, ids, _sampling(tokens), eos) for rid, ids in prompts.items()]
    seen = {rid: [] for rid in prompts}
    engine.add_requests(requests)
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id] += [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in output.logprobs or []]
    assert all(len(v) == tokens for v in seen.values())
    return seen


def _prompts(loaded):
    encode = loaded.tokenizer.encode
    system = encode("You are a terse assistant who answers in one short sentence. " * 20)  # 256 tokens: 16 blocks
    return system, encode(" Why is the sky blue?"), encode(" What is rain?")


def test_a_prefix_cache_hit_gives_the_same_logprobs_as_a_cold_prefill(loaded_rounded):
    system, question, other = _prompts(loaded_rounded)
    eos = loaded_rounded.eos_token_ids
    cold = _logprobs(make_engine(loaded_rounded, enable_prefix_caching=False), {"q": system + question}, eos)
    warm_engine = make_engine(loaded_rounded)
    _logprobs(warm_engine, {"first": system + other}, eos)
    warm = _logprobs(warm_engine, {"q": system + question}, eos)
    assert warm_engine.stats()["prefix_cache_hit_tokens"] >= 256
    assert warm["q"] == cold["q"]


def test_chunks_and_batch_mates_leave_logprobs_unchanged(loaded_rounded):
    system, question, _ = _prompts(loaded_rounded)
    eos = loaded_rounded.eos_token_ids
    alone = _logprobs(make_engine(loaded_rounded, enable_prefix_caching=False), {"q": system + question}, eos)["q"]
    # chunks of 48 tokens a step shared with five prompts of 5-97 words, and no prefix cache
    chunked = make_engine(loaded_rounded, enable_prefix_caching=False, max_num_batched_tokens=48, max_num_seqs=16)
    assert _logprobs(chunked, {**_words(loaded_rounded, 5, 23), "q": system + question}, eos)["q"] == alone


def test_preemption_leaves_logprobs_unchanged(loaded_rounded):
    prompts, eos = _words(loaded_rounded, 6, 7), loaded_rounded.eos_token_ids
    roomy = _logprobs(make_engine(loaded_rounded, max_model_len=128, enable_prefix_caching=False), prompts, eos, tokens=40)
    # 12 blocks of 16 tokens hold 192 tokens; six requests of up to 80 tokens need far more
    tight_engine = make_engine(loaded_rounded, max_model_len=128, num_kv_blocks=12, enable_prefix_caching=False)
    tight = _logprobs(tight_engine, prompts, eos, tokens=40)
    assert tight_engine.stats()["num_preemptions"] > 0
    assert tight == roomy


def _words(loaded, count: int, step: int) -> dict[str, list[int]]:
    """``count`` prompts of 5, 5 + step, ... common words."""
    words = "alpha beta gamma delta river stone cloud seven north quiet".split()
    return {f"m{i}": loaded.tokenizer.encode(" ".join(words[(i + j) % 10] for j in range(5 + step * i))) for i in range(count)}
