"""The load-time parity check sees a fused kernel that is wrong on the model's own activations.

Each fused part (RMS norm, RoPE, SiLU times up, a product's residual add) is checked on a test input as it is
installed; one that passes there and computes wrongly on real activations must still be refused at load. Each
case breaks one kernel after the engine installed it, as a bug on a user's CPU would, and the parity check must
refuse the model (its reference runs every module's own forward, not the fused ones)."""

from __future__ import annotations

import pytest

from app.config import EngineConfig, ModelConfig
from app.cpu import linear as cpu_linear
from app.cpu.ops import OPS, unavailable_reason
from app.engine.engine import LLMEngine
from app.engine.parity import ParityError, check_parity
from app.models import load_model
from tests.model.zoo.checkpoints import build_checkpoint

pytestmark = pytest.mark.model


class _OneOpWrong:
    """torch.ops.llm_serve with one op replaced."""

    def __init__(self, name: str, op) -> None:
        self.name, self.op = name, op

    def __getattr__(self, name: str):
        return self.op if name == self.name else getattr(OPS, name)


WRONG = {  # module patched, op, a wrong answer of the same shape (small: 5% off a norm moves logprobs by ~0.04 nats)
    "rms norm": ("app.cpu.norm", "rms_norm", lambda x, w, eps: OPS.rms_norm(x, w, eps) * 1.05),
    "rope": ("app.cpu.rotary", "rotary", lambda q, k, cos, sin: OPS.rotary(q, k, cos, -sin)),  # turned backwards
    "silu times up": ("app.cpu.activation", "silu_mul", lambda gate_up, lanes: OPS.silu_mul(gate_up, lanes) * 1.1),
}


def _engine(path):
    loaded = load_model(ModelConfig(source=str(path), dtype="float32", max_model_len=256))
    return loaded, LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=16))


@pytest.fixture
def llama(zoo_dir, tokenizer):
    """A fresh engine, as at load: nothing in its prefix cache computed by the kernels before they broke."""
    if unavailable_reason() is not None:
        pytest.skip(f"our CPU kernels do not run here ({unavailable_reason()}): no fused forward to check")
    return _engine(build_checkpoint("llama", zoo_dir, tokenizer))


@pytest.mark.parametrize("part", sorted(WRONG))
def test_a_fused_kernel_wrong_on_the_models_activations_is_refused(part, llama, monkeypatch):
    loaded, engine = llama
    module, name, wrong = WRONG[part]
    calls = []
    monkeypatch.setattr(f"{module}.OPS", _OneOpWrong(name, lambda *args: calls.append(1) or wrong(*args)))
    with pytest.raises(ParityError, match="LlamaForCausalLM cannot be served exactly: at generated token"):
        check_parity(engine, loaded)
    assert calls  # the engine ran the broken kernel


def test_a_residual_add_wrong_in_the_decoder_frame_is_refused(llama, monkeypatch):
    loaded, engine = llama
    apply_add, calls = cpu_linear.apply_add, []

    def wrong(*args):
        calls.append(1)
        return apply_add(*args) + 0.5 * args[-1]  # the residual counted one and a half times

    monkeypatch.setattr(cpu_linear, "apply_add", wrong)
    with pytest.raises(ParityError, match="cannot be served exactly"):
        check_parity(engine, loaded)
    assert calls


def test_the_kernels_as_built_pass_and_their_fused_forwards_are_back_after_the_check(llama):
    loaded, engine = llama
    assert check_parity(engine, loaded).max_gap <= 1e-4
    fused = {type(m.__dict__["forward"]).__name__ for m in loaded.model.modules() if "forward" in m.__dict__}
    assert {"FusedRMSNormForward", "DecoderLayerForward", "GatedMLPForward"} <= fused
