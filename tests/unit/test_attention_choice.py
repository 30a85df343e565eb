"""The attention route per kind of step (``app/engine/attention_choice.py``): steps classed by their queries, the
decision on fake timings and its cache, the settings that skip it, and a sequence attended correctly when its
prefill and its decodes take different paths."""

from types import SimpleNamespace

import pytest
import torch

from app.config import EngineConfig
from app.cpu import kernel_choice
from app.cpu.attention import PagedAttentionKernel
from app.cpu.kernel_choice import ChoiceCache
from app.engine import attention_choice
from app.engine.attention_choice import PHASES, AttentionRoute, attention_route, choose_route, step_kind
from app.engine.paged_attention import SequenceSlice
from tests.unit.cpu.conftest import loaded_ops, needs_kernels
from tests.unit.test_paged_attention import Sequences

MODEL = SimpleNamespace(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)


def _slices(*queries: int) -> list[SequenceSlice]:
    return [SequenceSlice(0, n, 0, []) for n in queries]


def test_steps_are_classed_by_their_longest_and_shortest_chunks():
    assert step_kind(_slices(1, 1, 1)) == "decode"
    assert step_kind(_slices(5, 5, 3)) == "decode"  # verifying drafts: a few queries a sequence
    assert step_kind(_slices(256)) == step_kind(_slices(16, 900)) == "prefill"
    assert step_kind(_slices(256, 1, 1)) == "mixed"


def test_the_route_gives_the_kernel_only_to_its_kinds_of_step():
    kernel = object()
    route = AttentionRoute(kernel, frozenset({"decode", "mixed"}))
    assert route.for_step(_slices(1, 1)) is kernel and route.for_step(_slices(300, 1)) is kernel
    assert route.for_step(_slices(300)) is None
    assert route.describe() == "decode: kernel, prefill: gather + SDPA, mixed: kernel"
    assert AttentionRoute(kernel).describe() == "kernel" and AttentionRoute(None).for_step(_slices(1)) is None


def test_torch_takes_a_kind_of_step_only_beyond_the_margin_and_the_decision_is_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_choice, "MIN_CPU_SHARE", 0.0)
    cache, timed = ChoiceCache(tmp_path / "choices.json"), []
    times = {"decode": {"kernel": 1e-3, "torch": 2e-3}, "prefill": {"kernel": 10e-3, "torch": 7e-3},
             "mixed": {"kernel": 10e-3, "torch": 9.5e-3}}  # 5% faster: noise, the kernel stays
    monkeypatch.setattr(attention_choice, "time_paths", lambda *args: timed.append(args) or times)
    first = choose_route("K", 6, 2, 8, torch.float32, 16, "build", cache)
    again = choose_route("K", 6, 2, 8, torch.float32, 16, "build", cache)
    assert first.phases == again.phases == frozenset({"decode", "mixed"}) and len(timed) == 1
    choose_route("K", 6, 2, 8, torch.bfloat16, 16, "build", cache)  # another KV dtype: timed for itself
    assert len(timed) == 2


def test_batch_invariance_or_a_named_kernel_runs_the_kernel_for_every_step_untimed(monkeypatch):
    monkeypatch.setattr(attention_choice, "time_paths", lambda *args: pytest.fail("timed"))
    for config in (EngineConfig(batch_invariant=True), EngineConfig(cpu_attention_kernel="kernel")):
        assert attention_route("K", config, MODEL, torch.float32).phases == frozenset(PHASES)
    assert attention_route(None, EngineConfig(), MODEL, torch.float32).kernel is None


@needs_kernels
def test_a_sequence_prefilled_through_sdpa_and_decoded_on_the_kernel_is_attended_exactly(monkeypatch):
    loaded_ops()
    monkeypatch.setattr(attention_choice, "CHUNK_QUERIES", 3)  # the test pool's sequences are short
    route = AttentionRoute(PagedAttentionKernel(), frozenset({"decode"}))
    sequences = Sequences()
    for new_tokens in ({"a": 5, "b": 4}, {"a": 1, "b": 1}, {"c": 6, "a": 1}, {"a": 1, "b": 1, "c": 1}):
        sequences.decode_kernel = route.for_step(_slices(*new_tokens.values()))
        got, expected, _ = sequences.step(new_tokens)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
