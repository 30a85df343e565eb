"""The attention route per kind of step (``app/engine/attention_choice.py``): steps classed by their queries, the
decision on fake timings and its cache, the settings that skip it, and a sequence attended correctly when its
prefill and its decodes take different paths."""

import pytest
import torch

from app.config import EngineConfig
from app.cpu import kernel_choice
from app.cpu.attention import PagedAttentionKernel
from app.cpu.kernel_choice import ChoiceCache
from app.engine import attention_choice
from app.engine.attention_choice import PHASES, AttentionRoute, attention_route, choose_route
from app.engine.paged_attention import SequenceSlice
from tests.unit.cpu.conftest import loaded_ops, needs_kernels
from tests.unit.test_paged_attention import Sequences

def _slices(*queries: int) -> list[SequenceSlice]:
    return [SequenceSlice(i, n, 0, [0] * 80) for i, n in enumerate(queries)]


POOL = torch.zeros(1, 2, 80 * 16, 2, 8)


def test_the_route_gives_each_part_of_a_step_its_path():
    kernel = PagedAttentionKernel()
    prompts_on_sdpa = AttentionRoute(kernel, frozenset({"decode"}))
    decodes = prompts_on_sdpa.batch(POOL, 16, _slices(1, 1))
    assert decodes.kernel is kernel and decodes.kernel_decode is not None
    mixed = prompts_on_sdpa.batch(POOL, 16, [SequenceSlice(0, 300, 0, [0] * 80), SequenceSlice(300, 1, 40, [1] * 80),
                                             SequenceSlice(301, 256, 100, [2] * 80)])
    assert [(p.query_start, p.length) for p in mixed.prompts] == [(0, 300), (301, 256)] and mixed.rest_rows.tolist() == [300]
    assert mixed.prompts[0].mask is None and mixed.prompts[1].mask.shape == (256, 356)
    assert AttentionRoute(kernel).batch(POOL, 16, _slices(300)).prompts == []
    decodes_on_torch = AttentionRoute(kernel, frozenset({"prompt"})).batch(POOL, 16, _slices(1, 1))
    assert decodes_on_torch.kernel is None
    assert prompts_on_sdpa.describe() == "decode steps: kernel, prompt chunks of 256+ tokens: SDPA, the rest: kernel"
    assert AttentionRoute(kernel).describe() == "kernel" and AttentionRoute(None).batch(POOL, 16, _slices(1)).kernel is None


def test_torch_takes_a_choice_only_beyond_the_margin_and_the_decision_is_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_choice, "MIN_CPU_SHARE", 0.0)
    cache, timed = ChoiceCache(tmp_path / "choices.json"), []
    times = {"decode": {"kernel": 1e-3, "torch": 0.95e-3},  # 5% faster: noise, the kernel stays
             "prompt": {"kernel": 10e-3, "torch": 7e-3}}
    monkeypatch.setattr(attention_choice, "time_paths", lambda *args: timed.append(args) or times)
    first = choose_route("K", 6, 2, 8, torch.float32, 16, "build", cache)
    again = choose_route("K", 6, 2, 8, torch.float32, 16, "build", cache)
    assert first.phases == again.phases == frozenset({"decode"}) and len(timed) == 1
    choose_route("K", 6, 2, 8, torch.bfloat16, 16, "build", cache)  # another KV dtype: timed for itself
    assert len(timed) == 2


def test_auto_takes_the_timed_route_for_the_models_head_layout(monkeypatch, caplog):
    chosen = []
    monkeypatch.setattr(attention_choice, "choose_route", lambda kernel, *layout: chosen.append(layout[:4])
                        or AttentionRoute(kernel, frozenset({"decode"})))
    with caplog.at_level("INFO", logger="app.engine.attention_choice"):
        route = attention_route("K", EngineConfig(), 6, 2, 8, torch.bfloat16)
    assert chosen == [(6, 2, 8, torch.bfloat16)] and route.phases == frozenset({"decode"})
    assert "prompt chunks of 256+ tokens: SDPA" in caplog.text


def test_batch_invariance_or_a_named_kernel_runs_the_kernel_for_everything_untimed(monkeypatch):
    monkeypatch.setattr(attention_choice, "time_paths", lambda *args: pytest.fail("timed"))
    for config in (EngineConfig(batch_invariant=True), EngineConfig(cpu_attention_kernel="kernel")):
        assert attention_route("K", config, 6, 2, 8, torch.float32).phases == frozenset(PHASES)
    assert attention_route(None, EngineConfig(), 6, 2, 8, torch.float32).kernel is None


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_prompt_chunks_through_sdpa_beside_kernel_queries_equal_causal_attention(kv_dtype):
    """Prompt chunks through SDPA (from the first token, and a chunk continuing one), in steps beside decodes and
    short chunks on the kernel: every output is causal attention over the sequence (a bf16 pool's keys rounded as
    stored, for SDPA too)."""
    loaded_ops()
    sequences = Sequences(PagedAttentionKernel(), kv_dtype)
    sequences.sdpa_prompts, sequences.sdpa_prompt_min = True, 5  # the test pool's sequences are short
    steps = ({"a": 6, "b": 3}, {"a": 1, "b": 1, "c": 6}, {"c": 5, "a": 1, "b": 1}, {"a": 1, "b": 2})
    for new_tokens in steps:
        got, expected, batch = sequences.step(new_tokens)
        assert [p.length for p in batch.prompts] == [n for n in new_tokens.values() if n >= 5]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
