"""Speculative decoding in the engine (n-gram drafts, and a draft model's drafts as its replicas answer them;
lossless verification): a greedy request's output is exactly the target's own, alone and inside a batch, and
speculation actually happens. (That sampled
outputs follow the target's distribution is tested on the rejection sampler: tests/unit/spec.)"""

import pytest
import torch

from app.config import SpecConfig
from app.engine import Request, SamplingParams
from app.spec.remote import DraftResult, draft_sampling
from tests.model.conftest import PROMPTS, greedy, make_engine, our_kernels_compute, run_engine

pytestmark = pytest.mark.model

NEW_TOKENS = 24
NGRAM = SpecConfig(drafter="ngram", num_speculative_tokens=4)
# Alone, every other prompt (prose, a chat turn, a repeated sentence, lists): each batch test runs all 16.
ALONE = list(enumerate(PROMPTS))[::2]


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
def plain(loaded_rounded):
    """The target alone: each prompt's greedy tokens and logprobs without speculation, inside one batch."""
    return _run_with_logprobs(make_engine(loaded_rounded, max_model_len=512), _requests(loaded_rounded, PROMPTS, "p", logprobs=0))


def test_inside_a_batch_of_16_speculation_changes_no_token(loaded_rounded, plain):
    engine = make_engine(loaded_rounded, max_model_len=512, speculative=NGRAM)
    got = _run_with_logprobs(engine, _requests(loaded_rounded, PROMPTS, "p", logprobs=0))
    assert [[t for t, _ in got[k]] for k in plain] == [[t for t, _ in plain[k]] for k in plain]
    if our_kernels_compute():  # our kernels compute a position's row the same in any step: same bits
        assert got == plain
    stats = engine.stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted_tokens"] > 0  # it did speculate, and gain
    assert stats["num_steps"] < NEW_TOKENS + 2  # fewer steps than one token each would need (+ the prefill)
    assert stats["spec_mean_acceptance_length"] == pytest.approx(1 + stats["spec_num_accepted_tokens"] / stats["spec_num_drafts"])


def test_alone_speculation_changes_no_token(loaded_rounded, plain):
    engine = make_engine(loaded_rounded, max_model_len=512, speculative=NGRAM)
    for index, prompt in ALONE:
        [request] = _requests(loaded_rounded, [prompt], "p", logprobs=0)
        request.request_id = f"p-{index}"
        got = _run_with_logprobs(engine, [request])
        assert [t for t, _ in got[request.request_id]] == [t for t, _ in plain[request.request_id]], prompt
    assert engine.stats()["spec_num_accepted_tokens"] > 0


def test_penalties_and_sampling_see_the_drafts_before_each_position(loaded_rounded):
    """Verification uses each position's own processed distribution: a repetition penalty counting the drafts
    before it, and sampling truncated to one token (top_k 1), both give exactly the plain decode's tokens."""
    prompt = loaded_rounded.tokenizer.encode(PROMPTS[12])  # a repeated sentence: long n-gram matches
    params = [greedy(16, repetition_penalty=1.3), SamplingParams(max_tokens=16, min_tokens=16, temperature=0.8, top_k=1)]

    def run(**engine_fields):
        engine = make_engine(loaded_rounded, max_model_len=512, **engine_fields)
        requests = [Request(f"r{i}", prompt, p, loaded_rounded.eos_token_ids) for i, p in enumerate(params)]
        return run_engine(engine, requests), engine.stats()

    (plain_out, _), (spec_out, stats) = run(), run(speculative=NGRAM)
    assert spec_out == plain_out
    assert stats["spec_num_drafts"] > 0


@pytest.mark.cpu_only  # a sampled token follows its logprobs' bits, the same in any step on our kernels alone
def test_a_seeded_sampled_request_gives_its_tokens_without_speculation_alone_or_in_a_batch(loaded_rounded):
    """The draft-length policy drafts less in a larger batch: a seeded request's tokens must not follow it."""
    prompt = loaded_rounded.tokenizer.encode(PROMPTS[12])
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=11)

    def run(speculative, mates: int):
        engine = make_engine(loaded_rounded, max_model_len=512, speculative=speculative)
        others = _requests(loaded_rounded, [PROMPTS[i] for i in range(mates)], "mate")
        out = run_engine(engine, [Request("seeded", prompt, params, loaded_rounded.eos_token_ids), *others])["seeded"]
        return out, engine.stats().get("spec_num_drafts", 0)

    (plain, _), (alone, drafts), (in_batch, _) = run(SpecConfig(), 0), run(NGRAM, 0), run(NGRAM, 7)
    assert alone == plain == in_batch and len(plain) >= 1 and drafts > 0


def test_preemption_and_stop_conditions_with_speculation(loaded_rounded):
    """A pool too small for every sequence: drafts, rejected blocks and recompute still leave the output alone."""
    prompts = [PROMPTS[12], PROMPTS[3], PROMPTS[14], PROMPTS[0]]
    expected = run_engine(make_engine(loaded_rounded, max_model_len=512), _requests(loaded_rounded, prompts, "s"))
    engine = make_engine(loaded_rounded, max_model_len=128, num_kv_blocks=9, speculative=NGRAM)  # 144 token slots for ~180 tokens
    got = run_engine(engine, _requests(loaded_rounded, prompts, "s"))
    assert got == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_drafts"] > 0
    assert stats["kv_blocks_used"] == 0


def test_a_stop_an_accepted_draft_reaches_ends_the_request_where_nothing_could_follow_it(loaded_rounded):
    """Number words only, and nothing may follow " nine" (each " nine <word>" a bad word): " nine" must end the answer,
    and a stop (string or token) there does. The prompt's repetition drafts " nine" and beyond; the position after
    it, with every token banned, is never reached: the request stops as it does without speculation. Without a stop
    it is reached, and the request fails there as it does without speculation."""
    words = "one two three four five six seven eight nine".split()
    ids = [loaded_rounded.tokenizer.encode(" " + w, add_special_tokens=False) for w in words]
    assert all(len(i) == 1 for i in ids)
    ids = [i[0] for i in ids]
    prompt = loaded_rounded.tokenizer.encode(" ".join(words * 3 + words[:4]))
    bans = dict(allowed_token_ids=tuple(ids), bad_words_token_ids=tuple((ids[-1], i) for i in ids))
    for stop, finish in ((dict(stop=(" nine",)), "stop"), (dict(stop_token_ids=(ids[-1],)), "stop"), ({}, "error")):
        requests = [Request("n", list(prompt), SamplingParams(max_tokens=12, temperature=0, **bans, **stop),
                            loaded_rounded.eos_token_ids) for _ in range(2)]
        expected = run_engine(make_engine(loaded_rounded, max_model_len=128), requests[:1])
        engine = make_engine(loaded_rounded, max_model_len=128, speculative=NGRAM)
        assert run_engine(engine, requests[1:]) == expected and engine.stats()["spec_num_drafts"] > 0
        assert [r.status.finish_reason for r in requests] == [finish, finish]
        assert all(r.error is None if finish == "stop" else "NoTokenLeftError" in r.error for r in requests)


# ---- a draft model on other replicas (drafter: model), its calls answered here by a draft engine ----------------
DRAFT_MODEL = SpecConfig(drafter="model", draft="draft", num_speculative_tokens=4)


def _answer_draft_calls(draft_engine, calls, eos_token_ids, corrupt_every: int, sessions: bool = True,
                        together: bool = True) -> list[DraftResult]:
    """What a draft replica answers (ModelServer.propose: the draft model's tokens after each call's context, with
    the distributions sampled ones were drawn from), with every ``corrupt_every``-th proposal replaced by a token
    the target will not choose, to force rejections (a replaced token lies outside the distribution sent with it:
    the target then verifies that answer as one-hot). ``together``: a step's calls in one batch, as a draft replica
    runs them; else each alone, in order (a sequence's second call of a step then resumes what its first left)."""
    requests = {call.call_id: Request(f"draft-{call.call_id}", call.prompt_token_ids,
                                      draft_sampling(call.sampling, len(call.output_token_ids), call.num_tokens),
                                      eos_token_ids, output_token_ids=list(call.output_token_ids), drafter=None,
                                      detokenize=False, session_id=call.sequence_id if sessions else None)
                for call in calls}
    probs = {request.request_id: [] for request in requests.values()}
    for batch in ([list(requests.values())] if together else [[r] for r in requests.values()]):
        draft_engine.add_requests(batch)
        while draft_engine.has_unfinished_requests():
            for output in draft_engine.step():
                probs[output.request_id] += [lp.sampled_from for lp in output.logprobs or []]
    results = []
    for call in calls:
        request = requests[call.call_id]
        tokens, sampled_from = list(request.output_token_ids[len(call.output_token_ids):]), probs[request.request_id]
        if corrupt_every:
            tokens = [0 if (call.call_id + i) % corrupt_every == 0 else t for i, t in enumerate(tokens)]
        sent = sampled_from if len(sampled_from) == len(tokens) and tokens else None
        results.append(DraftResult(call.call_id, call.drafter, call.sequence_id, tokens, elapsed_s=0.001, probs=sent))
    return results


def _run_with_draft_model(target, draft_engine, requests, eos_token_ids, corrupt_every: int = 3,
                          sessions: bool = True, together: bool = True) -> dict[str, list]:
    """Step the target; after each step answer its draft calls (a sequence waiting for drafts is not scheduled)."""
    seen = {r.request_id: [] for r in requests}
    target.add_requests(requests)
    while target.has_unfinished_requests():
        for output in target.step():
            seen[output.request_id] += [(lp.token_id, lp.logprob) for lp in output.logprobs or []]
        calls = target.take_draft_calls()
        target.add_draft_results(_answer_draft_calls(draft_engine, calls, eos_token_ids, corrupt_every, sessions, together))
    return seen


def test_with_a_draft_model_inside_a_batch_of_16_no_token_changes(loaded_rounded, plain):
    target = make_engine(loaded_rounded, max_model_len=512, speculative=DRAFT_MODEL)
    draft_engine = make_engine(loaded_rounded, max_model_len=512)
    got = _run_with_draft_model(target, draft_engine, _requests(loaded_rounded, PROMPTS, "p", logprobs=0), loaded_rounded.eos_token_ids)
    assert [[t for t, _ in got[k]] for k in plain] == [[t for t, _ in plain[k]] for k in plain]
    stats = target.stats()
    assert stats["spec_num_accepted_tokens"] > 0  # drafts were kept ...
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]  # ... and some rejected
    assert stats["num_steps"] < NEW_TOKENS + 2
    assert stats["kv_blocks_used"] == 0


def test_with_a_draft_model_each_prompt_alone_gives_the_targets_tokens(loaded_rounded, plain):
    target = make_engine(loaded_rounded, max_model_len=512, speculative=DRAFT_MODEL)
    draft_engine = make_engine(loaded_rounded, max_model_len=512)
    tokens = NEW_TOKENS // 2  # the first half of each plain answer (EOS is masked there too: the same tokens)
    for index, prompt in ALONE[::2]:  # a draft round trip per step: four prompts alone (all 16 run in a batch above)
        request = Request(f"p-{index}", loaded_rounded.tokenizer.encode(prompt), greedy(tokens), loaded_rounded.eos_token_ids)
        _run_with_draft_model(target, draft_engine, [request], loaded_rounded.eos_token_ids, corrupt_every=4)
        assert request.output_token_ids == [t for t, _ in plain[request.request_id][:tokens]], prompt
    assert target.stats()["spec_num_drafts"] >= len(ALONE[::2])


def test_the_draft_engine_hands_each_sequences_kv_from_call_to_call(loaded_rounded, plain):
    """Each call of a sequence resumes the KV its last call left (rolled back to what the two share), where the
    prefix cache alone keeps full blocks only: fewer tokens computed, the same output."""
    computed = {}
    for sessions in (True, False):
        target = make_engine(loaded_rounded, max_model_len=512, speculative=DRAFT_MODEL)
        draft_engine = make_engine(loaded_rounded, max_model_len=512)
        requests = _requests(loaded_rounded, PROMPTS[:2], "p", logprobs=0)
        got = _run_with_draft_model(target, draft_engine, requests, loaded_rounded.eos_token_ids, corrupt_every=4,
                                    sessions=sessions, together=False)
        assert [[t for t, _ in got[k]] for k in got] == [[t for t, _ in plain[k]] for k in got]
        stats = draft_engine.stats()
        computed[sessions] = stats["mean_tokens_per_step"] * stats["num_steps"]
        assert stats["kv_blocks_used"] == 0 and (stats["kv_blocks_parked"] > 0) == sessions  # kept, reclaimable
    assert computed[True] < 0.5 * computed[False], computed


def test_a_request_resuming_its_sessions_kv_computes_what_a_fresh_engine_does(loaded_rounded):
    """The KV a session hands on, rolled back mid-block, gives the next request the tokens and logprobs it gets
    from scratch (the last request's extra tokens are overwritten, never read)."""
    prompt = loaded_rounded.tokenizer.encode(PROMPTS[3])
    engine = make_engine(loaded_rounded, max_model_len=512)
    first = Request("a", prompt, greedy(12), loaded_rounded.eos_token_ids, session_id="s")
    run_engine(engine, [first])
    context = first.output_token_ids[:7] + [first.output_token_ids[7] + 1]  # parts from what the session computed
    resumed = Request("b", prompt, greedy(20, logprobs=0), loaded_rounded.eos_token_ids, output_token_ids=list(context), session_id="s")
    fresh = Request("b", prompt, greedy(20, logprobs=0), loaded_rounded.eos_token_ids, output_token_ids=list(context))
    got = _run_with_logprobs(engine, [resumed])["b"]
    assert resumed.num_cached_tokens == len(prompt) + 7
    want = _run_with_logprobs(make_engine(loaded_rounded, max_model_len=512), [fresh])["b"]
    assert [token for token, _ in got] == [token for token, _ in want]
    if our_kernels_compute():  # our kernels compute a position's row the same in any step: same bits
        assert got == want
    else:  # torch's products sum a prefill's rows in another order than a decode step's
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4


def test_with_a_draft_model_that_never_answers_the_target_decodes_on_alone(loaded_rounded, plain):
    """Lost draft calls (a dead draft replica) cost time, never tokens: each wait ends after max_draft_wait_ms."""
    target = make_engine(loaded_rounded, max_model_len=512, speculative=SpecConfig(drafter="model", draft="d", max_draft_wait_ms=1))
    [request] = _requests(loaded_rounded, [PROMPTS[0]], "p", logprobs=0)
    request.request_id = "p-0"
    target.add_requests([request])
    while target.has_unfinished_requests():
        target.step()
        target.take_draft_calls()  # sent nowhere
    assert request.output_token_ids == [t for t, _ in plain["p-0"]]
    assert target.stats()["spec_num_drafts"] == 0 and target.stats()["kv_blocks_used"] == 0


def test_sampled_requests_verify_the_draft_models_own_distribution(loaded_rounded):
    """At temperature 1 a draft model that is the target itself sends q = p on its top tokens, so min(1, p/q)
    accepts a first draft with probability (nearly) the mass of those tokens: measured 0.94 over ~20 drafts,
    where the same drafts verified as one-hot pass with probability p(x) (measured 0.48; the bound below sits
    3 standard deviations above that, and that the two rates differ is tested without a model:
    tests/unit/spec/test_spec_sampled_drafts.py)."""
    torch.manual_seed(0)  # the draft's and the verifier's draws (no request is seeded)
    target = make_engine(loaded_rounded, max_model_len=512, speculative=SpecConfig(drafter="model", draft="d", adaptive=False))
    draft_engine = make_engine(loaded_rounded, max_model_len=512)
    requests = [Request(f"s-{i}", loaded_rounded.tokenizer.encode(p), SamplingParams(max_tokens=20, min_tokens=20, temperature=1.0),
                        loaded_rounded.eos_token_ids) for i, p in enumerate(PROMPTS[:4])]
    _run_with_draft_model(target, draft_engine, requests, loaded_rounded.eos_token_ids, corrupt_every=0)
    assert all(len(r.output_token_ids) == 20 for r in requests)
    stats = target.stats()
    assert stats["spec_num_drafts"] > 12 and stats["kv_blocks_used"] == 0
    first_position = stats["spec_num_accepted_tokens_per_pos"][0] / stats["spec_num_drafts"]
    assert first_position > 0.7, first_position
