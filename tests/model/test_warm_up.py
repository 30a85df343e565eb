"""A model's warm-up proves it generates, readies the grammar path, then runs one step at the full token budget (the
largest activations)."""

import dataclasses

from app.server import _warm_up
from tests.model.conftest import make_engine


def test_warm_up_generates_then_runs_a_step_of_the_whole_token_budget(loaded_rounded):
    engine = make_engine(loaded_rounded, max_model_len=512, max_num_batched_tokens=96)
    assert _warm_up(engine, loaded_rounded, 96) > 0
    assert not engine.has_unfinished_requests()
    assert engine.counters.last_step_tokens == 96  # the full-budget prompt, prefilled in one step
    assert engine.counters.num_generated_tokens == 4  # two tokens, one under a grammar, then one
    assert engine.runner.sampler.grammars._tokenizer is not None  # built now, not in a constrained request's step


def test_the_full_step_fits_a_short_context(loaded_rounded):
    loaded = dataclasses.replace(loaded_rounded, max_model_len=40)
    engine = make_engine(loaded, max_num_batched_tokens=2048)
    _warm_up(engine, loaded, 2048)
    assert engine.counters.last_step_tokens == 39  # max_model_len - 1 prompt tokens, room for the one output
