"""Our RoPE kernel (llm_serve::rotary): transformers' exact bits, used only where it gives them, never process-wide."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from app.config import EngineConfig
from app.cpu.decoder import DecoderLayerForward, fuse_decoder_layers
from app.cpu.linear import pack_cpu_linears
from app.cpu.rotary import KernelRotary, rotary as KERNEL, rotary_for
from app.engine.paged_attention import register_paged_attention
from tests.unit.cpu.conftest import loaded_ops, needs_kernels

pytestmark = needs_kernels
TORCH_ROPE = modeling_llama.apply_rotary_pos_emb


@pytest.fixture(autouse=True, scope="module")
def _built():
    loaded_ops()  # this machine supports the kernels: a failed build fails every test below


def _inputs(batch, tokens, dim, q_heads=9, k_heads=3, cos_batch=None):
    """q and k as the attention layer makes them: transposed views of one fused projection's output."""
    fused = torch.randn(batch, tokens, (q_heads + 2 * k_heads) * dim) * 4
    q = fused[..., : q_heads * dim].view(batch, tokens, q_heads, dim).transpose(1, 2)
    k = fused[..., q_heads * dim : (q_heads + k_heads) * dim].view(batch, tokens, k_heads, dim).transpose(1, 2)
    angles = torch.rand(cos_batch or batch, tokens, dim) * 100
    return q, k, angles.cos(), angles.sin()


@pytest.mark.parametrize("dim", [2, 6, 64, 128])  # pairs below and above the vector width
@pytest.mark.parametrize("batch, tokens", [(1, 1), (1, 37), (2, 3), (1, 400)])  # 400: the multi-threaded path
def test_gives_transformers_bits_exactly(batch, tokens, dim):
    q, k, cos, sin = _inputs(batch, tokens, dim)
    expected, got = TORCH_ROPE(q, k, cos, sin), KERNEL(q, k, cos, sin)
    for e, g in zip(expected, got):
        assert g.shape == e.shape
        assert torch.equal(g, e)


def test_reads_contiguous_inputs_and_broadcasts_one_cos_over_the_batch():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    angles = torch.rand(1, 5, 8) * 10
    cos, sin = angles.cos(), angles.sin()
    for e, g in zip(TORCH_ROPE(q, k, cos, sin), KERNEL(q, k, cos, sin)):
        assert torch.equal(g, e)


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def test_decoder_layers_use_it_and_the_model_keeps_its_bits_while_transformers_keeps_its_function():
    model = _tiny_llama()
    register_paged_attention(model)
    pack_cpu_linears(model)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        assert fuse_decoder_layers(model) == 2
        forwards = [layer.forward for layer in model.model.layers]
        assert all(isinstance(f, DecoderLayerForward) and isinstance(f.rotary, KernelRotary) for f in forwards)
        assert torch.equal(model(ids, use_cache=False).logits, expected)
    assert modeling_llama.apply_rotary_pos_emb is TORCH_ROPE  # nothing replaced outside this model


def test_calls_it_cannot_serve_go_to_transformers_function():
    fused = KernelRotary(TORCH_ROPE)
    q, k, cos, sin = _inputs(1, 3, 8)
    cases = {
        "autograd": (q.clone().requires_grad_(), k, cos, sin),
        "bf16": (q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16()),
        "partial rotary": (q, k, cos[..., :4], sin[..., :4]),
    }
    for name, args in cases.items():
        with torch.set_grad_enabled(name == "autograd"):
            if name == "partial rotary":
                with pytest.raises(RuntimeError):  # transformers' own error, not a wrong answer from us
                    fused(*args)
                continue
            for e, g in zip(TORCH_ROPE(*args), fused(*args)):
                assert torch.equal(g, e) and g.dtype == e.dtype and g.requires_grad == e.requires_grad, name
    q4, k4 = q.transpose(1, 2), k.transpose(1, 2)  # [B, T, H, D] with unsqueeze_dim=2
    for e, g in zip(TORCH_ROPE(q4, k4, cos, sin, unsqueeze_dim=2), fused(q4, k4, cos, sin, unsqueeze_dim=2)):
        assert torch.equal(g, e)


def _interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-J style rotation of adjacent pairs: another function under the same name."""
    def rotate(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def test_another_rotation_under_the_same_name_keeps_its_own():
    assert rotary_for(_interleaved_rope) is None
    assert isinstance(rotary_for(TORCH_ROPE), KernelRotary)


def test_the_setting_is_checked():
    assert EngineConfig(cpu_rotary_kernel="torch").cpu_rotary_kernel == "torch"
    with pytest.raises(ValueError, match="cpu_rotary_kernel"):
        EngineConfig(cpu_rotary_kernel="fast")
