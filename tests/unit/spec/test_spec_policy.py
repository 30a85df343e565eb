"""The draft-length policy: the speed-up model, the acceptance estimate, falling to 0, probing, bounds."""

import math
import random

import pytest

from app.spec.policy import (DraftLengthPolicy, DraftPolicyConfig, StepCosts, expected_speedup, expected_tokens_per_step,
                             verify_cost)


def simulate_draft(rng: random.Random, a: float, k: int) -> int:
    """Accepted tokens of a k-token draft whose tokens pass independently with probability a."""
    accepted = 0
    while accepted < k and rng.random() < a:
        accepted += 1
    return accepted


def test_expected_tokens_per_step_is_the_geometric_sum_and_matches_simulation():
    rng = random.Random(1)
    for a in (0.0, 0.3, 0.75, 1.0):
        for k in (0, 1, 4):
            assert expected_tokens_per_step(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))
            mean = sum(simulate_draft(rng, a, k) + 1 for _ in range(20_000)) / 20_000
            assert mean == pytest.approx(expected_tokens_per_step(a, k), abs=0.05)


def test_speedup_by_hand():
    # a = 0.5, c = 0.1: k=1 1.5/1.1 = 1.364, k=2 1.75/1.2 = 1.458, k=3 1.875/1.3 = 1.442
    assert expected_speedup(0.5, 2, 0.1) == pytest.approx(1.75 / 1.2)
    assert expected_speedup(0.7, 0, 0.3) == 1.0
    policy = DraftLengthPolicy(DraftPolicyConfig(num_speculative_tokens=5, cost_ratio=0.1))
    assert policy.best_length(0.5, batch_size=1) == 2
    assert policy.best_length(0.9, batch_size=1) == 5  # 3.12 at 5, still rising
    assert policy.best_length(0.2, batch_size=1) == 1  # k=1: 1.2 / 1.1 = 1.09; k=2: 1.24 / 1.2 = 1.03
    policy.cost_ratio = 0.3
    assert policy.best_length(0.2, batch_size=1) == 0  # k=1: 1.2 / 1.3 < 1: drafting does not pay


def test_a_large_batch_turns_speculation_off():
    # S = 64: at B = 1 verification is ~free (v = 1 + k/65); at B = 256, v(1) = (1 + 4*2) / 5 = 1.8 and
    # E(0.8, 1) = 1.8, so even one drafted token costs more than it brings
    assert verify_cost(3, 1, 64.0) == pytest.approx((1 + 4 / 64) / (1 + 1 / 64))
    assert verify_cost(1, 256, 64.0) == pytest.approx(1.8)
    assert verify_cost(7, 10_000, math.inf) == 1.0
    policy = DraftLengthPolicy(DraftPolicyConfig(num_speculative_tokens=4, cost_ratio=0.05, saturation_tokens=64))
    assert policy.best_length(0.8, batch_size=1) == 4
    assert policy.best_length(0.8, batch_size=256) == 0
    assert 0 < policy.best_length(0.8, batch_size=16) <= 4


def test_starts_at_num_speculative_tokens_then_falls_to_zero_when_drafts_fail():
    policy = DraftLengthPolicy(DraftPolicyConfig(num_speculative_tokens=4, cost_ratio=0.3))
    assert policy.draft_length("r", batch_size=1) == 4
    lengths = []
    for _ in range(3):
        k = lengths[-1] if lengths else 4
        policy.record("r", k, 0)
        lengths.append(policy.draft_length("r", batch_size=1))
    assert lengths == [0, 0, 0]  # one failed draft: a = (0.8 * 0.5) / (0.8 * 1 + 1) = 0.22, k=1 gives 0.94
    assert policy.acceptance("r") < 0.25


def test_probes_while_off_and_comes_back_when_drafts_pass():
    cfg = DraftPolicyConfig(num_speculative_tokens=4, cost_ratio=0.3, probe_interval=8, max_probe_interval=32)
    policy = DraftLengthPolicy(cfg)
    policy.draft_length("r", 1)
    policy.record("r", 4, 0)

    def steps_until_probe():
        for step in range(1, 100):
            k = policy.draft_length("r", 1)
            if k:
                return step, k
        raise AssertionError("no probe")

    assert steps_until_probe() == (8, 4)
    policy.record("r", 4, 0)  # a failed probe: the next one waits twice as long, up to the cap
    assert steps_until_probe() == (16, 4)
    policy.record("r", 4, 0)
    assert steps_until_probe() == (32, 4)
    policy.record("r", 4, 0)
    assert steps_until_probe() == (32, 4)
    policy.record("r", 4, 4)  # the workload changed: the fresh probe outweighs the stale history
    after = []
    for _ in range(5):
        k = policy.draft_length("r", 1)
        after.append(k)
        policy.record("r", k, k)
    assert after == [4] * 5
    # and a later failure streak turns it off again, with the probe interval back at its start
    for streak in range(1, 20):
        k = policy.draft_length("r", 1)
        if k == 0:
            break
        policy.record("r", k, 0)
    # by hand: 6 full drafts leave s = t = 4 (1 - 0.8^6) / 0.2 = 14.8; after m failures a = s x / (s x + 5 (1 - x)),
    # x = 0.8^m, and k = 1 stops paying at a < 0.3 (1.3 / 1.3): x < 0.126, m = 10
    assert streak == 11
    assert steps_until_probe()[0] == 8 - 1  # this step's 0 was the first of the 8


def test_acceptance_estimate_converges_to_the_true_rate():
    rng = random.Random(2)
    policy = DraftLengthPolicy(DraftPolicyConfig(num_speculative_tokens=4, ema_decay=0.998))
    for _ in range(4_000):
        k = policy.draft_length("r", 1)
        assert k == 4  # c = 0, memory-bound target: drafting always pays
        policy.record("r", k, simulate_draft(rng, 0.6, k))
    assert policy.acceptance("r") == pytest.approx(0.6, abs=0.03)


def test_lengths_stay_within_bounds_and_sequences_are_independent():
    rng = random.Random(3)
    cfg = DraftPolicyConfig(num_speculative_tokens=6, min_draft_tokens=2, cost_ratio=0.15, saturation_tokens=128,
                            probe_interval=4)
    policy = DraftLengthPolicy(cfg)
    rates = {"good": 0.95, "bad": 0.05, "mixed": 0.5}
    seen = {name: set() for name in rates}
    for step in range(600):
        batch = rng.choice([1, 8, 64])
        names = list(rates)
        for name, k in zip(names, policy.draft_lengths(names, batch)):
            assert k == 0 or cfg.min_draft_tokens <= k <= cfg.num_speculative_tokens
            seen[name].add(k)
            if k:
                policy.record(name, k, simulate_draft(rng, rates[name], k))
    assert 0 in seen["bad"] and max(seen["good"]) == 6
    assert policy.acceptance("good") > 0.8 and policy.acceptance("bad") < 0.2
    policy.forget("good")
    assert policy.draft_length("good", 1) == 6  # no history again


def test_cost_ratio_updates_and_invalid_settings():
    policy = DraftLengthPolicy(DraftPolicyConfig(num_speculative_tokens=3, cost_ratio=0.1))
    policy.update_cost_ratio(0.5, weight=0.5)
    assert policy.cost_ratio == pytest.approx(0.3)
    with pytest.raises(ValueError):
        policy.record("r", 2, 3)
    with pytest.raises(ValueError):
        DraftPolicyConfig(num_speculative_tokens=3, min_draft_tokens=4)
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 2)


def test_step_costs_are_trusted_after_min_samples_and_follow_recent_steps():
    costs = StepCosts(decay=0.5, min_samples=2)
    costs.observe(4, 0.020)
    assert costs.seconds(4) is None and costs.ratio(4, 1) is None
    costs.observe(4, 0.030)
    assert costs.seconds(4) == pytest.approx(0.025)
    for _ in range(2):
        costs.observe(1, 0.010)
    assert costs.ratio(4, 1) == pytest.approx(2.5)
    costs.observe(8, 0.005)
    costs.observe(8, 0.005)  # noise: more tokens measured cheaper than fewer
    costs.observe(4, 0.025)
    assert costs.ratio(8, 4) == 1.0
    with pytest.raises(ValueError):
        costs.observe(0, 0.01)


def test_measured_step_costs_replace_the_smooth_model():
    # A kernel that takes rows four at a time (GPTQ's CPU int4 kernel): 1-4 tokens cost about the same, 5-8 more.
    costs = StepCosts(min_samples=1)
    for tokens, seconds in ((1, 0.0123), (2, 0.0128), (3, 0.0140), (4, 0.0149), (5, 0.0204), (6, 0.0217)):
        costs.observe(tokens, seconds)
    assert verify_cost(3, 1, 8.0, costs) == pytest.approx(0.0149 / 0.0123)
    assert verify_cost(4, 1, 8.0, costs) == pytest.approx(0.0204 / 0.0123)
    assert verify_cost(7, 1, 8.0, costs) == verify_cost(7, 1, 8.0)  # not measured: the model
    cfg = DraftPolicyConfig(num_speculative_tokens=5, saturation_tokens=8.0)
    smooth, measured = DraftLengthPolicy(cfg), DraftLengthPolicy(cfg, costs)
    assert smooth.best_length(0.76, 1) == 5
    assert measured.best_length(0.76, 1) == 3  # the last draft that fits the kernel's block of four rows


def test_policy_steers_away_from_an_expensive_length_once_the_engine_has_timed_it():
    # The policy first drafts what the smooth model says; after the engine reports what those steps cost it
    # settles where the measured costs say, and the expected speed-up there is what it would be told by hand.
    costs = StepCosts(min_samples=1)
    policy = DraftLengthPolicy(DraftPolicyConfig(num_speculative_tokens=4, saturation_tokens=8.0, start_from_prior=True,
                                                 prior_acceptance=0.76, prior_weight=50), costs)
    step = {1: 0.0123, 2: 0.0128, 3: 0.014, 4: 0.0149, 5: 0.0204}
    seen = []
    costs.observe(1, step[1])
    for i in range(6):
        k = policy.draft_length("seq", 1)
        seen.append(k)
        costs.observe(k + 1, step[k + 1])
    assert seen[0] == 4 and seen[-1] == 3
    best = max(range(1, 5), key=lambda k: expected_tokens_per_step(0.76, k) * step[1] / step[k + 1])
    assert best == 3


def test_a_probe_that_found_nothing_to_draft_stays_due():
    """No n-gram match at the probe's step: nothing was tried, so the next step looks again, and a later failed
    probe waits as long as the first would have (not twice as long per empty look)."""
    cfg = DraftPolicyConfig(num_speculative_tokens=4, cost_ratio=0.3, probe_interval=8, max_probe_interval=32)
    policy = DraftLengthPolicy(cfg)
    policy.draft_length("r", 1)
    policy.record("r", 4, 0)
    lengths = [policy.draft_length("r", 1) for _ in range(8)]
    assert lengths[-1] == 4 and not any(lengths[:-1])  # the probe is due
    policy.nothing_drafted("r")  # ... but there was nothing to draft
    assert policy.draft_length("r", 1) == 4  # due again at once
    policy.record("r", 4, 0)  # this one was tried and failed: the next waits twice the first interval
    steps = next(step for step in range(1, 100) if policy.draft_length("r", 1))
    assert steps == 16
