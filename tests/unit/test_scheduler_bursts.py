"""A burst going first in chunks: the mean first-token time it is chosen by, and the scheduler's choice under hand-made
step costs (the rest of the scheduler: test_scheduler.py)."""

import pytest
from app.engine.scheduler import Scheduler, mean_first_token_s

from tests.unit.test_scheduler import _request, _scheduler, _step_capped


def test_mean_first_token_time_of_a_burst_in_chunks():
    def cost(tokens, keys):
        return 0.01 + 0.01 * tokens + 0.001 * keys

    prompts = [(4, 0)] * 4  # each 4 tokens attends 1+2+3+4 = 10 keys
    # one step of 16 tokens beside one decode: 0.01 + 0.17 + 0.04, every first token at its end
    assert mean_first_token_s(prompts, 16, 1, cost) == pytest.approx(0.22)
    # two steps of 8: 0.01 + 0.09 + 0.02 = 0.12 for the first two; then 0.01 + 0.11 (two more decodes) + 0.02
    assert mean_first_token_s(prompts, 8, 1, cost) == pytest.approx((2 * 0.12 + 2 * (0.12 + 0.14)) / 4)
    # a chunk ending inside a prompt: it attends from where the last chunk left it
    assert mean_first_token_s([(6, 0)], 4, 0, cost) == pytest.approx(0.01 + 0.04 + 0.010 + 0.01 + 0.02 + 0.011)


def _burst_behind_one_stream(num_burst: int = 5) -> Scheduler:
    scheduler = _scheduler(num_blocks=256, max_num_batched_tokens=128)
    scheduler.add_request(_request("early", 4, max_tokens=50, first_token=0))
    _step_capped(scheduler, cap=16)
    for i in range(num_burst):  # 70 prompt tokens: 17.5 steps at the cap's 4 beside the stream, so the burst goes first
        scheduler.add_request(_request(f"burst{i}", 14, max_tokens=50, first_token=100 * (i + 1)))
    return scheduler


def test_a_burst_going_first_goes_in_one_step_where_a_step_costs_mostly_its_fixed_part():
    scheduler = _burst_behind_one_stream()
    steps = _step_capped(scheduler, cap=5, step_seconds=lambda tokens, keys: 1.0 + 0.001 * tokens)
    assert steps == {"early": 1, **{f"burst{i}": 14 for i in range(5)}}


def test_a_burst_going_first_goes_in_chunks_where_its_tokens_cost_most_and_keeps_the_chunk_to_its_end():
    scheduler = _burst_behind_one_stream()

    def cost(tokens, keys):
        return 0.01 + 0.01 * tokens

    steps = [_step_capped(scheduler, cap=5, step_seconds=cost)]
    while any(r.first_token_s is None for r in scheduler.running + list(scheduler.waiting)):
        steps.append(_step_capped(scheduler, cap=5, step_seconds=cost))
    prefilled = [sum(n for rid, n in step.items() if n > 1) for step in steps]
    assert 1 < len(steps) <= Scheduler.BURST_MAX_CHUNKS and sum(prefilled) == 70
    # the same chunk every step (the last takes what is left), also once the burst no longer outnumbers the streams
    assert prefilled[:-1] == [prefilled[0]] * (len(steps) - 1) and prefilled[-1] <= prefilled[0]
    assert steps[-1]["early"] == 1
    assert mean_first_token_s([(14, 0)] * 5, prefilled[0], 1, cost) < 0.95 * mean_first_token_s([(14, 0)] * 5, 70, 1, cost)
    # the burst done, a new prompt beside the streams keeps to the cap again
    scheduler.add_request(_request("late", 40, first_token=900))
    assert sum(_step_capped(scheduler, cap=10, step_seconds=cost).values()) == 10


def test_a_single_long_prompt_with_nothing_decoding_keeps_the_whole_step_whatever_the_cost():
    scheduler = _scheduler(num_blocks=256, max_num_batched_tokens=64)
    scheduler.add_request(_request("long", 60, first_token=100))
    assert _step_capped(scheduler, cap=4, step_seconds=lambda tokens, keys: 0.001 + 0.01 * tokens) == {"long": 60}
