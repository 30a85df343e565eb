"""Speculative-decoding counters: what a step adds, derived figures, merging, serialization."""

import json

import pytest
import torch

from app.spec.rejection import rejection_sample
from app.spec.stats import SpecDecodingStats


def test_counts_and_derived_figures_by_hand():
    stats = SpecDecodingStats.new(num_spec_tokens=3)
    stats.observe_draft(3, 2)  # positions 0, 1 accepted
    stats.observe_draft(3, 0)
    stats.observe_draft(2, 2)
    stats.observe_draft(0, 0)  # nothing drafted: not a draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 0]
    assert stats.acceptance_rate == pytest.approx(4 / 8)
    assert stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    assert stats.acceptance_rate_per_pos == pytest.approx([2 / 3, 2 / 3, 0.0])
    with pytest.raises(ValueError):
        stats.observe_draft(2, 3)


def test_empty_counters():
    stats = SpecDecodingStats()
    assert stats.acceptance_rate == 0.0 and stats.mean_acceptance_length == 1.0
    assert stats.num_accepted_tokens_per_pos == [] and stats.acceptance_rate_per_pos == []


def test_merge_adds_counters_and_pads_positions():
    a, b = SpecDecodingStats(), SpecDecodingStats()
    a.observe_draft(2, 1)
    b.observe_draft(4, 4)
    b.observe_draft(1, 0)
    total = a + b
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (3, 7, 5)
    assert total.num_accepted_tokens_per_pos == [2, 1, 1, 1]
    assert total.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert a.num_drafts == 1 and b.num_drafts == 2  # + leaves its operands alone
    a += b
    assert a == total
    # merging equals observing everything in one place
    one = SpecDecodingStats()
    for drafted, accepted in [(2, 1), (4, 4), (1, 0)]:
        one.observe_draft(drafted, accepted)
    assert one == total


def test_dict_round_trip_through_json():
    stats = SpecDecodingStats()
    stats.observe_batch([3, 1, 0], [1, 1, 0])
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["acceptance_rate"] == pytest.approx(2 / 4)
    assert data["mean_acceptance_length"] == pytest.approx(2.0)
    assert data["num_accepted_tokens_per_pos"] == [2, 0, 0]
    assert SpecDecodingStats.from_dict(data) == stats


def test_observe_a_rejection_sampler_step():
    p = torch.zeros(3, 4, 5)
    p[:, :, 1] = 1.0  # the target always wants token 1
    draft = torch.tensor([[1, 1, 2], [2, 1, 1], [1, 1, 1]])
    counts = torch.tensor([3, 3, 2])
    out = rejection_sample(draft, counts, None, p, is_greedy=[True, False, True])
    stats = SpecDecodingStats()
    stats.observe_batch(counts, out.num_accepted)
    assert out.num_accepted.tolist() == [2, 0, 2]
    assert stats.num_accepted_tokens == 4 and stats.num_draft_tokens == 8
    assert stats.num_accepted_tokens_per_pos == [2, 2, 0]


def test_the_per_token_acceptance_counts_only_tested_tokens():
    """After a rejection the rest of a draft is never tested: the policy's per-token chance is accepted over
    tested (k=4 at a true 0.7: accepted over drafted reads ~0.44)."""
    stats = SpecDecodingStats.new(4)
    stats.observe_batch([4, 4, 4], [4, 1, 0])  # tested: 4, 2 (one pass, one fail), 1
    assert stats.num_trials == 7 and stats.per_token_acceptance == 5 / 7 and stats.acceptance_rate == 5 / 12
    assert SpecDecodingStats.from_dict(stats.to_dict()).per_token_acceptance == 5 / 7
    assert (stats + stats).num_trials == 14
