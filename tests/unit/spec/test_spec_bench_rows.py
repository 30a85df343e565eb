"""The speculative benchmark's arithmetic: Leviathan's prediction, and the same with the measured step cost."""

import pytest

from app.bench.spec_bench import _row
from app.spec.policy import expected_tokens_per_step


def _run(tokens: int, wall_s: float, steps: int, drafts: int, draft_tokens: int, accepted: int) -> dict:
    spec = {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted}
    return {"output_tok_per_s": tokens / wall_s, "tokens": tokens, "wall_s": wall_s, "steps": steps, "spec": spec}


def test_a_verifying_step_that_costs_more_than_a_plain_one_is_what_separates_measured_from_leviathan():
    base = _run(96, 96 * 0.018, 96, 0, 0, 0)  # 18 ms a plain step
    run = _run(96, 40 * 0.024, 40, 40, 120, 80)  # 40 steps of 24 ms, every one drafted 3
    row = _row("rewrite", 1, "ngram", run, base, 3, 0.0)
    a = 80 / 120
    assert row["acceptance_rate"] == pytest.approx(a, abs=1e-3) and row["draft_share"] == 1.0
    assert row["leviathan_speedup"] == pytest.approx(expected_tokens_per_step(a, 3), abs=1e-3)
    assert row["verify_cost"] == pytest.approx(24 / 18, abs=1e-3)
    assert row["prediction_with_verify_cost"] == pytest.approx(expected_tokens_per_step(a, 3) * 18 / 24, abs=1e-3)
    # what is left is the model's tokens per step (E) against the run's (96 / 40)
    assert row["measured_over_prediction_with_verify_cost"] == pytest.approx(96 / 40 / expected_tokens_per_step(a, 3), abs=1e-3)
    assert row["speedup"] == pytest.approx((96 / 40) / (24 / 18), abs=1e-3)


def test_a_run_that_drafted_nothing_has_no_prediction():
    base = _run(96, 2.0, 96, 0, 0, 0)
    row = _row("chat", 1, "model", _run(96, 2.1, 96, 0, 0, 0), base, 4, 1.1)
    assert row["verify_cost"] is None and row["prediction_with_verify_cost"] is None
    assert row["measured_over_predicted"] is None and row["leviathan_speedup"] == 1.0
