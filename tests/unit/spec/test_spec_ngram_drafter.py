"""The n-gram drafter's draft lengths: a new sequence starts from what the drafter's drafts achieve so far."""

from app.config import SpecConfig
from app.engine.request import Request, SamplingParams
from app.spec.controller import NgramDrafter
from app.spec.policy import PRIOR_AFTER_DRAFTS, StepCosts

REPEATING = [5, 6, 7, 8, 9] * 6  # every suffix has an earlier match: prompt lookup always finds a window


def _drafter(**fields) -> NgramDrafter:
    costs = StepCosts(min_samples=1)
    for tokens in range(1, 64):  # a compute-bound step: each batched token adds 10% of a one-token step
        costs.observe(tokens, 1.0 + 0.1 * (tokens - 1))
    return NgramDrafter(SpecConfig(drafter="ngram", num_speculative_tokens=4, **fields), max_model_len=256, step_costs=costs)


def _request(request_id: str) -> Request:
    return Request(request_id, list(REPEATING), SamplingParams(max_tokens=64, temperature=0), eos_token_ids=[])


def _drafts_for_a_new_sequence(drafter: NgramDrafter, accepted_per_draft: int, batch_size: int) -> int:
    for i in range(PRIOR_AFTER_DRAFTS):  # earlier sequences' drafts of 4 tokens, `accepted_per_draft` of them accepted
        drafter.record(_request(f"earlier-{i}"), 4, accepted_per_draft)
    fresh = _request("fresh")
    drafter.propose(fresh, limit=4, batch_size=batch_size, target_step_s=0.02, now=0.0)
    return len(fresh.spec_token_ids)


def test_where_the_drafters_drafts_mostly_pass_a_new_sequence_drafts_at_once():
    assert _drafts_for_a_new_sequence(_drafter(), accepted_per_draft=4, batch_size=8) >= 3


def test_where_they_mostly_fail_a_new_sequence_in_a_large_batch_does_not_verify_a_window_first():
    assert _drafts_for_a_new_sequence(_drafter(), accepted_per_draft=0, batch_size=8) == 0


def test_not_adaptive_it_drafts_the_full_window_whatever_it_costs():
    assert _drafts_for_a_new_sequence(_drafter(adaptive=False), accepted_per_draft=0, batch_size=8) == 4
