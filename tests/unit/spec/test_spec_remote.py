"""Drafts from a draft model on other replicas (app/spec/remote.py): what is asked for, when an answer is used,
what a sequence waits for, and what a failure does. No model: answers are written by hand."""

import pytest

from app.config import SpecConfig
from app.engine.request import Request, SamplingParams
from app.spec.remote import DRAFT_TOP_N, DraftResult, ModelDrafter, draft_sampling

STEP_S = 0.02  # the target's one-token step, for the cost ratio


def _drafter(**fields) -> ModelDrafter:
    config = SpecConfig(drafter="model", draft="d", num_speculative_tokens=4, **fields)
    return ModelDrafter(0, config, max_model_len=1000)


def _request(output: list[int] | None = None, max_tokens: int = 100) -> Request:
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0))
    request.output_token_ids = list(output or [])
    return request


def _answer(drafter: ModelDrafter, tokens: list[int], now: float, elapsed_s: float = 0.01) -> DraftResult:
    [call] = drafter.take_calls()
    return DraftResult(call.call_id, 0, call.sequence_id, tokens, elapsed_s=elapsed_s)


def test_a_new_sequence_asks_for_a_window_and_waits_for_it():
    drafter, request = _drafter(), _request([7])
    drafter.propose(request, limit=4, batch_size=1, target_step_s=STEP_S, now=0.0)
    assert request.spec_token_ids == [] and request.awaiting_draft
    [call] = drafter.take_calls()
    assert (call.prompt_token_ids, call.output_token_ids, call.num_tokens) == ([1, 2, 3], [7], 4)
    assert drafter.take_calls() == []  # asked once: a second call waits for this one


def test_an_answer_for_where_the_sequence_stands_becomes_its_drafts_and_the_next_window_is_asked_ahead():
    drafter, request = _drafter(), _request([7])
    drafter.propose(request, 4, 1, STEP_S, 0.0)
    assert drafter.add_result(_answer(drafter, [8, 9, 10, 11], 0.0), now=0.01)
    drafter.propose(request, 4, 1, STEP_S, 0.01)
    assert request.spec_token_ids == [8, 9, 10, 11] and not request.awaiting_draft
    [ahead] = drafter.take_calls()  # drafted while the target verifies: assumes all four kept, one more token
    assert ahead.output_token_ids == [7, 8, 9, 10, 11] and ahead.num_tokens == 5


def test_an_answer_is_used_past_the_tokens_the_target_emitted_meanwhile_if_it_guessed_them():
    drafter, request = _drafter(), _request([7])
    drafter.propose(request, 4, 1, STEP_S, 0.0)
    drafter.add_result(_answer(drafter, [8, 9, 10, 11], 0.0), now=0.01)
    request.output_token_ids += [8, 9]  # the target moved on by two tokens, the ones the draft guessed
    drafter.propose(request, 4, 1, STEP_S, 0.02)
    assert request.spec_token_ids == [10, 11]


def test_an_answer_that_the_target_contradicted_is_dropped_and_the_sequence_asks_again():
    drafter, request = _drafter(), _request([7])
    drafter.propose(request, 4, 1, STEP_S, 0.0)
    drafter.add_result(_answer(drafter, [8, 9, 10, 11], 0.0), now=0.01)
    request.output_token_ids += [8, 5]  # the target rejected the second draft token
    drafter.propose(request, 4, 1, STEP_S, 0.02)
    assert request.spec_token_ids == [] and request.awaiting_draft
    [again] = drafter.take_calls()
    assert again.output_token_ids == [7, 8, 5]


def test_a_pre_drafted_window_after_a_rejection_is_never_used():
    drafter, request = _drafter(), _request([7])
    drafter.propose(request, 4, 1, STEP_S, 0.0)
    drafter.add_result(_answer(drafter, [8, 9, 10, 11], 0.0), now=0.01)
    drafter.propose(request, 4, 1, STEP_S, 0.01)  # verifying 8 9 10 11; window after them asked ahead
    [ahead] = drafter.take_calls()
    request.output_token_ids += [8, 9, 4]  # two kept, then the target's own token
    drafter.propose(request, 4, 1, STEP_S, 0.05)  # a fresh call from where it stands supersedes the ahead one
    [fresh] = drafter.take_calls()
    assert fresh.output_token_ids == [7, 8, 9, 4]
    late = DraftResult(ahead.call_id, 0, "r", [12, 13, 14, 15, 16], elapsed_s=0.01)
    assert not drafter.add_result(late, now=0.06)  # overtaken: ignored
    drafter.propose(request, 4, 1, STEP_S, 0.07)
    assert request.spec_token_ids == []


def test_a_sequence_waits_at_most_max_draft_wait_ms_then_decodes_without_drafts():
    drafter, request = _drafter(max_draft_wait_ms=100), _request([7])
    drafter.propose(request, 4, 1, STEP_S, 0.0)
    assert request.awaiting_draft and drafter.wait_deadline(request) == pytest.approx(0.1)
    drafter.expire(request, now=0.05)
    assert request.awaiting_draft
    drafter.expire(request, now=0.1)
    assert not request.awaiting_draft


def test_a_failed_call_stands_the_drafter_down_for_a_while():
    drafter, request = _drafter(), _request([7])
    drafter.propose(request, 4, 1, STEP_S, 0.0)
    [call] = drafter.take_calls()
    drafter.add_result(DraftResult(call.call_id, 0, "r", [], error="ActorDiedError: gone"), now=1.0)
    drafter.expire(request, now=1.0)
    assert not request.awaiting_draft  # decodes on without drafts
    drafter.propose(request, 4, 1, STEP_S, 1.1)
    assert request.spec_token_ids == [] and not request.awaiting_draft and drafter.take_calls() == []
    drafter.propose(request, 4, 1, STEP_S, 5.0)  # the pause is over: it asks again
    assert len(drafter.take_calls()) == 1


def test_no_call_crosses_the_context_length():
    drafter = ModelDrafter(0, SpecConfig(drafter="model", draft="d", num_speculative_tokens=4), max_model_len=6)
    request = _request([7, 8])  # 5 tokens of 6
    drafter.propose(request, limit=4, batch_size=1, target_step_s=STEP_S, now=0.0)
    [call] = drafter.take_calls()
    assert call.num_tokens == 1


@pytest.mark.parametrize("draft_s_per_token, drafts", [(STEP_S, False), (STEP_S / 20, True)])
def test_new_sequences_draft_only_while_the_measured_draft_cost_pays(draft_s_per_token, drafts):
    drafter, first = _drafter(), _request([7])
    drafter.propose(first, 4, 1, STEP_S, 0.0)
    drafter.add_result(_answer(drafter, [8, 9, 10, 11], 0.0, elapsed_s=1.0), now=0.01)  # the first also prefilled
    first.output_token_ids += [8, 9, 10, 11, 12]
    drafter.propose(first, 4, 1, STEP_S, 0.02)
    for call in drafter.take_calls():  # a second answer measures the drafting cost
        drafter.add_result(DraftResult(call.call_id, 0, "r", [1, 1, 1, 1], elapsed_s=4 * draft_s_per_token), now=0.03)
    fresh = _request([7])
    fresh.request_id = "new"
    drafter.propose(fresh, 4, 1, STEP_S, 1.0)
    assert fresh.awaiting_draft == drafts and bool(drafter.take_calls()) == drafts


def test_the_draft_model_samples_as_the_request_does_cut_to_its_top_tokens_unseeded_under_its_penalties():
    sampling = SamplingParams(max_tokens=50, temperature=0.8, top_p=0.9, seed=3, stop=("x",), logprobs=2,
                              frequency_penalty=0.5, min_tokens=20, prompt_logprobs=5)
    draft = draft_sampling(sampling, num_output_tokens=10, num_tokens=4)
    assert (draft.temperature, draft.top_p, draft.seed, draft.stop, draft.logprobs) == (0.8, 0.9, None, (), None)
    assert draft.prompt_logprobs is None  # the draft model keeps its prefix cache and computes no prompt's logits
    assert (draft.max_tokens, draft.min_tokens, draft.frequency_penalty, draft.draft_top_n) == (14, 14, 0.5, DRAFT_TOP_N)
    greedy = draft_sampling(SamplingParams(max_tokens=50, temperature=0.0, repetition_penalty=1.2), 10, 4)
    assert (greedy.temperature, greedy.draft_top_n, greedy.repetition_penalty) == (0.0, 0, 1.2)


def test_sampled_proposals_become_drafts_with_the_distributions_they_were_drawn_from():
    drafter, request = _drafter(), _request([7])
    drafter.propose(request, 4, 1, STEP_S, 0.0)
    [call] = drafter.take_calls()
    probs = [([11, 12], [0.75, 0.25]), ([12, 13], [0.5, 0.5]), ([13], [1.0]), ([14, 1], [0.9, 0.1])]
    drafter.add_result(DraftResult(call.call_id, 0, request.request_id, [11, 12, 13, 14], probs=probs), 0.01)
    request.output_token_ids.append(11)  # the target emitted the first proposal meanwhile
    drafter.propose(request, 4, 1, STEP_S, 0.02)
    assert request.spec_token_ids == [12, 13, 14] and request.spec_draft_probs == probs[1:]


def test_proposals_outside_the_distributions_sent_with_them_are_verified_as_one_hot():
    drafter, request = _drafter(), _request([7])
    drafter.propose(request, 4, 1, STEP_S, 0.0)
    [call] = drafter.take_calls()
    probs = [([11], [1.0]), ([99], [1.0])]  # 12 was not drawn from its distribution
    drafter.add_result(DraftResult(call.call_id, 0, request.request_id, [11, 12], probs=probs), 0.01)
    drafter.propose(request, 4, 1, STEP_S, 0.02)
    assert request.spec_token_ids == [11, 12] and request.spec_draft_probs is None


def test_a_sequence_the_draft_model_cannot_draft_for_stops_asking():
    drafter, request = _drafter(), _request([7])
    drafter.propose(request, 4, 1, STEP_S, 0.0)
    drafter.add_result(_answer(drafter, [], 0.0), now=0.01)  # e.g. its context is longer than the draft model's
    drafter.propose(request, 4, 1, STEP_S, 0.02)
    assert request.spec_token_ids == [] and not request.awaiting_draft and drafter.take_calls() == []


def test_where_drafting_cannot_pay_a_rare_probe_that_nobody_waits_for_measures_the_cost_again():
    drafter = _drafter()
    drafter.draft_s_per_token = 2 * STEP_S  # measured: drafting a token costs two target steps
    request = _request([7])
    asks = []
    for step in range(5000):
        drafter.propose(request, 4, 1, STEP_S, float(step))
        assert not request.awaiting_draft and request.spec_token_ids == []
        asks += drafter.take_calls()
        if asks:
            break
    assert len(asks) == 1 and 4000 < step < 5000  # one probe, after thousands of steps without a call
    answer = DraftResult(asks[0].call_id, 0, "r", [5, 9, 10, 11], elapsed_s=0.5, s_per_token=STEP_S / 10)
    drafter.add_result(answer, now=7000.0)
    assert drafter.draft_s_per_token == pytest.approx(0.8 * 2 * STEP_S + 0.2 * STEP_S / 10)
    request.output_token_ids.append(5)  # the target moved on by the token the draft guessed
    drafter.propose(request, 4, 1, STEP_S, 7000.0)
    assert request.spec_token_ids == [9, 10, 11]  # still fits: verified


def test_proposals_past_the_targets_vocabulary_are_cut_before_the_first_of_them():
    """A draft model with a larger (padded) vocabulary may propose an id the target has no embedding for: fed to
    the target's step it would fail the whole batch; verification would reject it anyway."""
    config = SpecConfig(drafter="model", draft="d", num_speculative_tokens=4)
    drafter, request = ModelDrafter(0, config, max_model_len=1000, vocab_size=100), _request([7])
    drafter.propose(request, 4, 1, STEP_S, 0.0)
    [call] = drafter.take_calls()
    probs = [([11], [1.0]), ([12], [1.0]), ([100], [1.0]), ([13], [1.0])]
    drafter.add_result(DraftResult(call.call_id, 0, request.request_id, [11, 12, 100, 13], probs=probs), 0.01)
    drafter.propose(request, 4, 1, STEP_S, 0.02)
    # where the window ends depends on what the draft drew: verified against those distributions, the kept ones
    # would be biased (a sampled 100 drops the window where a rejection would have drawn from the residual); one-hot
    # verification is lossless for any tokens
    assert request.spec_token_ids == [11, 12] and request.spec_draft_probs is None


@pytest.mark.parametrize("values", [[-1.0], [0.0], [float("nan")], [0.5], [2.0]])
def test_a_distribution_that_is_none_or_gives_its_proposal_no_chance_is_verified_as_one_hot(values):
    """A corrupted or foreign answer: a negative q accepted a token the target rules out; q = 0 accepted any token
    the target allows (P(u * 0 < p) = 1); neither is what the draft drew from."""
    drafter, request = _drafter(), _request([7])
    drafter.propose(request, 4, 1, STEP_S, 0.0)
    [call] = drafter.take_calls()
    drafter.add_result(DraftResult(call.call_id, 0, request.request_id, [11], probs=[([11], values)]), 0.01)
    drafter.propose(request, 4, 1, STEP_S, 0.02)
    assert request.spec_token_ids == [11] and request.spec_draft_probs is None
