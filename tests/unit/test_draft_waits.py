"""What the engine's driver waits for while every running sequence waits for a draft model's answer (drafter: model):
that answer, or its deadline, not a busy loop of empty steps, when requests also wait for admission and none can
be admitted (app/engine/engine.py: idle_wait_s). A tiny random Llama; no answer ever comes."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from app.config import EngineConfig, SpecConfig
from app.engine import LLMEngine, Request, SamplingParams
from app.models.loader import LoadedModel

WAIT_MS = 500


class _Bytes:
    """A token is a byte: what the detokenizer needs of a tokenizer."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _engine(max_num_seqs: int) -> LLMEngine:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2)
    loaded = LoadedModel("tiny", LlamaForCausalLM(config).eval(), _Bytes(), torch.device("cpu"), torch.float32, 64, frozenset())
    speculative = SpecConfig(drafter="model", draft="d", num_speculative_tokens=4, adaptive=False, max_draft_wait_ms=WAIT_MS)
    return LLMEngine(loaded, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, num_kv_blocks=32,
                                          speculative=speculative, parity_check=False, separate_process=False,
                                          max_decode_step_ms=0, torch_threads=1, cpu_threads_bind="none"))


def _requests(count: int) -> list[Request]:
    return [Request(f"r{i}", [5, 6, 7, 8 + i], SamplingParams(max_tokens=8, temperature=0)) for i in range(count)]


def test_with_every_sequence_waiting_for_drafts_and_no_slot_for_the_next_the_driver_waits_for_the_deadline():
    engine = _engine(max_num_seqs=2)
    engine.add_requests(_requests(3))
    for _ in range(3):  # prefill, first tokens, then each sequence asks for its drafts
        engine.step()
    assert [r.awaiting_draft for r in engine.scheduler.running] == [True, True] and len(engine.scheduler.waiting) == 1
    assert engine.step() == []  # nothing to run: no drafts yet, no slot for r2
    assert 0.5 * WAIT_MS / 1000 < engine.idle_wait_s() <= WAIT_MS / 1000


def test_a_request_waiting_for_a_free_slot_is_admitted_at_once():
    engine = _engine(max_num_seqs=3)
    engine.add_requests(_requests(2))
    for _ in range(3):
        engine.step()
    assert all(r.awaiting_draft for r in engine.scheduler.running)
    engine.add_requests(_requests(3)[2:])
    assert engine.idle_wait_s() == 0.0  # the next step admits it
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["r0", "r1", "r2"]
