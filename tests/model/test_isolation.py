"""One request's failure is its own: an exception while sampling, matching stop strings or detokenizing one request,
or in a forward pass it is part of, fails that request alone; the others of the same steps finish with all their
tokens, the tokens they get alone."""

import pytest

from app.engine import Request, SamplingParams
from app.engine.detokenizer import IncrementalDetokenizer
from app.engine.sampling import Sampler
from tests.model.conftest import make_engine

pytestmark = pytest.mark.model

MARK = "<<fail this request>>"  # a stop string only the bad request carries
TOKENS = 8


def _requests(loaded, bad: bool) -> list[Request]:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"]
    samplings = [SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0),
                 SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0.9, seed=7, logprobs=2),
                 SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS - 1, temperature=0.7, top_p=0.9, seed=11,
                                stop=(MARK,) if bad else ()),  # its last token is looked at for stop strings
                 SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0, repetition_penalty=1.3)]
    ids = ["greedy", "seeded", "bad" if bad else "other", "penalized"]
    return [Request(i, loaded.tokenizer.encode(p), s, loaded.eos_token_ids) for i, p, s in zip(ids, prompts, samplings)]


def _run(engine, requests):
    engine.add_requests(requests)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def _raise_for_marked(original):
    def wrapped(self, *args, **kwargs):
        if MARK in self._stop:
            raise RuntimeError("injected failure")
        return original(self, *args, **kwargs)
    return wrapped


def _raise_while_sampling_marked(original):
    def wrapped(self, logits, requests):
        if any(r.request_id == "bad" for r in requests):
            raise RuntimeError("injected failure")
        return original(self, logits, requests)
    return wrapped


@pytest.mark.parametrize("where", ["sampling", "stop matching", "detokenizing"])
def test_an_exception_for_one_request_fails_it_alone(loaded_rounded, where, monkeypatch):
    alone = _requests(loaded_rounded, bad=False)
    _run(make_engine(loaded_rounded), alone)  # the same requests without the failure
    if where == "sampling":
        monkeypatch.setattr(Sampler, "_sample", _raise_while_sampling_marked(Sampler._sample))
    else:
        name = "_find_stop" if where == "stop matching" else "_decode_new"
        monkeypatch.setattr(IncrementalDetokenizer, name, _raise_for_marked(getattr(IncrementalDetokenizer, name)))
    requests = _requests(loaded_rounded, bad=True)
    finals = _run(make_engine(loaded_rounded), requests)
    assert finals["bad"].finish_reason == "error" and "injected failure" in finals["bad"].error
    for request, reference in zip(requests, alone):
        if request.request_id != "bad":
            assert finals[request.request_id].finish_reason == "length"
            assert request.output_token_ids == reference.output_token_ids  # seeded ones too: the same draws


def test_a_seed_the_generator_refuses_fails_at_admission_alone(loaded_rounded):
    engine = make_engine(loaded_rounded)
    requests = _requests(loaded_rounded, bad=False)
    bad = Request("bad", requests[0].prompt_token_ids, SamplingParams(max_tokens=4, temperature=1.0, seed=7), frozenset())
    bad.sampling.seed = "7"  # past the edge's checks (the API answers 400): the engine still fails it alone
    finals = _run(engine, [*requests, bad])
    assert finals["bad"].finish_reason == "error" and finals["bad"].num_output_tokens == 0
    assert all(finals[r.request_id].finish_reason == "length" for r in requests)


def test_a_request_with_no_room_in_the_context_fails_at_admission_alone(loaded_rounded):
    """Below the API (which answers 400), a prompt filling the whole context would wait for blocks forever."""
    engine = make_engine(loaded_rounded, max_model_len=64)
    requests = _requests(loaded_rounded, bad=False)
    full = Request("full", list(range(100, 164)), SamplingParams(max_tokens=4), frozenset())
    engine.add_requests([*requests, full])
    finals = {out.request_id: out for _ in range(50) if engine.has_unfinished_requests() for out in engine.step() if out.finished}
    assert not engine.has_unfinished_requests()
    assert finals["full"].finish_reason == "error" and "max_model_len=64" in finals["full"].error
    assert all(finals[r.request_id].finish_reason == "length" for r in requests)


def test_a_broken_gpu_context_stops_the_engine_instead_of_failing_every_step(loaded_rounded, monkeypatch):
    """A device-side assert leaves CUDA unusable for every later step: the core must die (Serve replaces the
    replica) rather than answer errors for good; an ordinary failure runs its step's requests apart (below)."""
    import torch

    engine = make_engine(loaded_rounded)
    engine.add_requests(_requests(loaded_rounded, bad=False))

    def lost(*args, **kwargs):
        raise torch.AcceleratorError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(engine.runner, "execute", lost)
    with pytest.raises(torch.AcceleratorError):
        engine.step()


def _failing_steps(engine, monkeypatch, fails, error=RuntimeError) -> list[int]:
    """The engine's forward passes raise ``error`` where ``fails(the step's request ids)``; returns each pass's size.
    A failing pass holds a tensor as it raises (its activations): no later pass may start while it is alive."""
    import weakref

    import torch

    original, sizes, held = engine.runner.execute, [], []

    def execute(output, blocks):
        assert all(ref() is None for ref in held), "a pass ran while a failed one's tensors were alive"
        ids = {item.request.request_id for item in output.scheduled}
        sizes.append(len(ids))
        if fails(ids):
            activations = torch.empty(1024)
            held.append(weakref.ref(activations))
            raise error(f"injected failure ({activations.numel()} floats held)")
        return original(output, blocks)

    monkeypatch.setattr(engine.runner, "execute", execute)
    return sizes


def test_a_forward_pass_failing_on_one_request_fails_it_alone_and_its_batch_mates_get_their_tokens(loaded_rounded, monkeypatch):
    """A pass that raises whenever one request is in it (its shapes, a kernel's bug): the step's requests run apart,
    in halves down to single requests; that one fails, the others get every token they get alone, seeded ones too."""
    alone = _requests(loaded_rounded, bad=False)
    _run(make_engine(loaded_rounded), alone)
    engine, requests = make_engine(loaded_rounded), _requests(loaded_rounded, bad=True)
    sizes = _failing_steps(engine, monkeypatch, lambda ids: "bad" in ids)
    finals = _run(engine, requests)
    assert finals["bad"].finish_reason == "error" and "injected failure" in finals["bad"].error
    assert finals["bad"].num_output_tokens == 0 and sizes[:5] == [4, 2, 2, 1, 1]  # the step, its halves, its last half apart
    assert engine.stats()["num_steps_run_apart"] == 1
    for request, reference in zip(requests, alone):
        if request.request_id != "bad":
            assert finals[request.request_id].finish_reason == "length"
            assert request.output_token_ids == reference.output_token_ids


def test_a_step_too_large_for_memory_runs_in_smaller_ones_and_every_request_completes(loaded_rounded, monkeypatch):
    """Out of memory on a step's size (a GPU's activations beside its KV pool): its halves fit, and every request
    completes with the tokens it gets alone."""
    import torch

    alone = _requests(loaded_rounded, bad=False)
    _run(make_engine(loaded_rounded), alone)
    engine, requests = make_engine(loaded_rounded), _requests(loaded_rounded, bad=False)
    sizes = _failing_steps(engine, monkeypatch, lambda ids: len(ids) > 2, error=torch.OutOfMemoryError)
    finals = _run(engine, requests)
    assert all(finals[r.request_id].finish_reason == "length" for r in requests) and max(sizes) == 4
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in alone]


def _failing_above(engine, monkeypatch, tokens: int, only: str | None = None) -> list[tuple[int, bool]]:
    """The engine's forward passes run out of memory (torch's CPU allocator's error) when they carry more than
    ``tokens`` tokens (only when request ``only`` is in them, if given); returns each pass's (tokens, failed)."""
    original, passes = engine.runner.execute, []

    def execute(output, blocks):
        size = sum(item.num_new_tokens for item in output.scheduled)
        ids = {item.request.request_id for item in output.scheduled}
        fails = size > tokens and (only is None or only in ids)
        passes.append((size, fails))
        if fails:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes (injected)")
        return original(output, blocks)

    monkeypatch.setattr(engine.runner, "execute", execute)
    return passes


def _two_waves(engine, loaded) -> tuple[dict, list[Request]]:
    """Four requests, one step, four more arriving: the second wave's prompts go beside the first wave's decodes."""
    first = _requests(loaded, bad=False)
    prompts = ["The largest planet is", "import numpy as np", "In a hole in the ground", "a, b, c, d,"]
    second = [Request(f"late{i}", loaded.tokenizer.encode(p), SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0),
                      loaded.eos_token_ids) for i, p in enumerate(prompts)]
    engine.add_requests(first)
    finals = {o.request_id: o for o in engine.step() if o.finished}
    return {**finals, **_run(engine, second)}, first + second


def test_after_a_step_runs_out_of_memory_later_steps_fit_without_a_failing_pass(loaded_rounded, monkeypatch):
    """The step that ran out of memory caps the steps after it at half its tokens: the second wave's prompts then go in
    steps that fit, instead of each step paying a failing pass before its parts run."""
    _, reference = _two_waves(make_engine(loaded_rounded), loaded_rounded)
    engine = make_engine(loaded_rounded)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in _requests(loaded_rounded, bad=False))
    passes = _failing_above(engine, monkeypatch, tokens=prompt_tokens // 2)
    finals, requests = _two_waves(engine, loaded_rounded)
    assert all(finals[r.request_id].finish_reason == "length" for r in requests)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in reference]
    assert passes[0] == (prompt_tokens, True) and engine.stats()["num_steps_run_apart"] == 1
    assert engine.stats()["step_token_cap"] == prompt_tokens // 2


def test_a_prompt_chunk_that_runs_out_of_memory_alone_is_retried_in_smaller_chunks(loaded_rounded, monkeypatch):
    """A request whose prompt chunk alone does not fit is not failed: it prefills in the smaller chunks the cap makes
    and gets the tokens it gets without the shortage; a request that fails even on a single token fails, alone."""
    alone = _requests(loaded_rounded, bad=False)
    _run(make_engine(loaded_rounded), alone)
    engine, requests = make_engine(loaded_rounded), _requests(loaded_rounded, bad=False)
    _failing_above(engine, monkeypatch, tokens=2)
    finals = _run(engine, requests)
    assert all(finals[r.request_id].finish_reason == "length" for r in requests)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in alone]
    assert engine.stats()["num_steps_run_apart"] == 1 and engine.stats()["step_token_cap"] <= 2

    engine, requests = make_engine(loaded_rounded), _requests(loaded_rounded, bad=True)
    _failing_above(engine, monkeypatch, tokens=0, only="bad")  # "bad" never fits, even alone on one token
    finals = _run(engine, requests)
    assert finals["bad"].finish_reason == "error" and "can't allocate memory" in finals["bad"].error
    for request, reference in zip(requests, alone):
        if request.request_id != "bad":
            assert finals[request.request_id].finish_reason == "length"
            assert request.output_token_ids == reference.output_token_ids
