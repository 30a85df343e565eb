"""Every batching mode gives transformers' greedy output, and batching never changes a request's output (greedy;
fp32 on the embedded model's bf16-rounded weights, `loaded_rounded`)."""

import pytest

from app.engine import Request, SamplingParams
from tests.model.conftest import PROMPTS, greedy, hf_greedy_divergence, make_engine, run_engine, transformers_model

pytestmark = pytest.mark.model

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompt_ids(loaded_rounded):
    return [loaded_rounded.tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("mode", ["none", "dynamic", "continuous"])
def test_every_mode_gives_transformers_greedy_tokens(loaded_rounded, prompt_ids, mode):
    # A small token budget makes the long prompt's prefill span several steps, mixed with decodes.
    engine = make_engine(loaded_rounded, batching=mode, max_num_batched_tokens=32, max_num_seqs=16)
    # "none" runs one sequence after another, a step per token each: every other prompt is enough there
    chosen = list(range(len(prompt_ids)))[:: 2 if mode == "none" else 1]
    requests = [Request(f"{mode}-{i}", prompt_ids[i], greedy(MAX_TOKENS), loaded_rounded.eos_token_ids) for i in chosen]
    outputs = run_engine(engine, requests)
    differences = {PROMPTS[i]: where for i, r in zip(chosen, requests)
                   if (where := hf_greedy_divergence(loaded_rounded, prompt_ids[i], outputs[r.request_id], MAX_TOKENS))}
    assert not differences, f"{mode}: differs from transformers' greedy output: {differences}"
    assert engine.stats()["num_steps"] >= MAX_TOKENS


def _mixed_batch(loaded, count: int) -> list[list[int]]:
    """``count`` prompts from 1 to ~150 tokens, so prefill chunks and decodes share steps."""
    words = "alpha beta gamma delta river stone cloud seven north quiet engine paper".split()
    text = [" ".join(words[(i * 7 + j) % len(words)] for j in range(1 + (i * 37) % 120)) for i in range(count)]
    return [loaded.tokenizer.encode(t) for t in text]


def test_alone_equals_inside_a_batch_of_32(loaded_rounded):
    prompts = _mixed_batch(loaded_rounded, 32)
    batch = [Request(f"b{i}", ids, greedy(16), loaded_rounded.eos_token_ids) for i, ids in enumerate(prompts)]
    batched = run_engine(make_engine(loaded_rounded, max_num_batched_tokens=256), batch, group=False)
    for index in (0, 9, 17, 31):
        alone = Request(f"alone{index}", prompts[index], greedy(16), loaded_rounded.eos_token_ids)
        assert run_engine(make_engine(loaded_rounded), [alone])[alone.request_id] == batched[f"b{index}"]


def test_preemption_leaves_outputs_unchanged(loaded_rounded):
    prompts = _mixed_batch(loaded_rounded, 6)[:6]
    make = lambda tag: [Request(f"{tag}{i}", ids[:40], greedy(40), loaded_rounded.eos_token_ids) for i, ids in enumerate(prompts)]
    roomy = run_engine(make_engine(loaded_rounded, max_model_len=128), make("r"))
    # 12 blocks of 16 tokens hold 192 tokens; six requests of up to 80 tokens need far more.
    tight_engine = make_engine(loaded_rounded, max_model_len=128, num_kv_blocks=12)
    tight = run_engine(tight_engine, make("t"))
    assert tight_engine.stats()["num_preemptions"] > 0
    assert [tight[f"t{i}"] for i in range(6)] == [roomy[f"r{i}"] for i in range(6)]
    assert tight_engine.blocks.num_free_blocks == tight_engine.blocks.num_blocks


def test_shared_prefix_hits_the_cache_with_unchanged_outputs(loaded_rounded):
    system = loaded_rounded.tokenizer.encode("You are a terse assistant who answers in one short sentence. " * 4)
    questions = [loaded_rounded.tokenizer.encode(q) for q in (" Why is the sky blue?", " What is rain?")]
    engine = make_engine(loaded_rounded)
    first = Request("p0", system + questions[0], greedy(12), loaded_rounded.eos_token_ids)
    run_engine(engine, [first])
    hits_before = engine.stats()["prefix_cache_hit_tokens"]
    second = Request("p1", system + questions[1], greedy(12), loaded_rounded.eos_token_ids)
    out = run_engine(engine, [second])["p1"]
    assert engine.stats()["prefix_cache_hit_tokens"] - hits_before >= 16 * (len(system) // 16)
    assert second.num_cached_tokens >= 16
    assert hf_greedy_divergence(loaded_rounded, system + questions[1], out, 12) is None


def test_every_block_is_free_after_aborts_and_completions(loaded_rounded):
    engine = make_engine(loaded_rounded)
    prompts = _mixed_batch(loaded_rounded, 8)
    requests = [Request(f"a{i}", ids, greedy(12), loaded_rounded.eos_token_ids) for i, ids in enumerate(prompts)]
    engine.add_requests(requests)
    for _ in range(3):
        engine.step()
    for request in requests[::2]:
        assert engine.abort_request(request.request_id).finish_reason == "abort"
    assert engine.blocks.num_used_blocks > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(len(r.output_token_ids) == 12 for r in requests[1::2])


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(loaded_rounded):
    ids = loaded_rounded.tokenizer.encode("Write a story about a dragon:")
    sampled = lambda rid: Request(rid, ids, SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11))
    alone = run_engine(make_engine(loaded_rounded), [sampled("s-alone")])["s-alone"]
    others = [Request(f"o{i}", p, SamplingParams(max_tokens=16, temperature=1.0)) for i, p in enumerate(_mixed_batch(loaded_rounded, 7))]
    in_batch = run_engine(make_engine(loaded_rounded), [*others, sampled("s-batch")])["s-batch"]
    assert alone == in_batch and len(alone) == 16


def test_logprobs_match_transformers_scores(loaded_rounded):
    ids = loaded_rounded.tokenizer.encode("The capital of France is")
    request = Request("lp", ids, greedy(6, logprobs=3), loaded_rounded.eos_token_ids)
    engine = make_engine(loaded_rounded)
    engine.add_requests([request])
    logprobs = []
    while engine.has_unfinished_requests():
        logprobs += [lp for out in engine.step() for lp in (out.logprobs or [])]
    import torch

    with torch.inference_mode():
        out = transformers_model(loaded_rounded).generate(
            torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
    for step, lp in enumerate(logprobs):
        expected = out.logits[step][0].float().log_softmax(-1)  # raw logits of that step
        assert lp.token_id == int(out.sequences[0, len(ids) + step])
        assert abs(lp.logprob - float(expected[lp.token_id])) < 1e-4
        assert [t for t, _ in lp.top] == expected.topk(3).indices.tolist()
    assert len(logprobs) == 6


def test_a_finished_request_reports_its_queue_prefill_and_decode_time(loaded_rounded):
    """One sequence at a time: the second request waits for the first, so its queue time covers the first's run."""
    engine = make_engine(loaded_rounded, batching="none")
    requests = [Request(f"t{i}", loaded_rounded.tokenizer.encode(p), greedy(6), loaded_rounded.eos_token_ids) for i, p in enumerate(PROMPTS[:2])]
    engine.add_requests(requests)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.phase_times for o in engine.step() if o.finished})
    first, second = finished["t0"], finished["t1"]
    assert set(first) == set(second) == {"queue_s", "prefill_s", "decode_s"}
    assert all(value >= 0 for value in (*first.values(), *second.values()))
    assert second["queue_s"] >= first["prefill_s"] + first["decode_s"]  # it waited while the first ran
