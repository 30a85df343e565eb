"""The one-frame decoder layer forward (app/cpu/decoder.py): the module's bits, installed only where it gives them."""

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, OlmoConfig, OlmoForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from app.config import EngineConfig
from app.cpu.decoder import DecoderLayerForward, fuse_decoder_layers, unfuse_decoder_layers
from app.cpu.linear import pack_cpu_linears
from app.cpu.ops import unavailable_reason
from app.engine.paged_attention import register_paged_attention


def _tiny_llama(bias: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=bias)
    return LlamaForCausalLM(config).eval()


def _prepared(bias: bool = False) -> LlamaForCausalLM:
    """As the runner leaves a model before fusing: paged attention registered, Linear weights packed (with our
    kernels, the fixed-order one for every row count, whatever the bake-off would pick on this CPU)."""
    model = _tiny_llama(bias)
    register_paged_attention(model)
    assert pack_cpu_linears(model, batch_invariant=unavailable_reason() is None) > 0
    return model


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if unavailable_reason() is None:  # our kernels: a product's bits depend on nothing but its inputs
        assert torch.equal(actual, expected)
    else:  # the library's products (oneDNN, MKL) may not give one input the same bits from call to call
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def _fused(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m.__dict__.get("forward"), DecoderLayerForward)]


@pytest.mark.parametrize("bias", [False, True])  # Qwen2-style q/k/v biases ride in the shared GEMM
def test_fused_layers_give_the_modules_bits(bias):
    model = _prepared(bias)
    ids = torch.randint(0, 96, (1, 11))
    with torch.inference_mode():
        expected = model(ids, use_cache=False).logits
        assert fuse_decoder_layers(model) == 3
        _assert_same(model(ids, use_cache=False).logits, expected)


def test_generate_with_a_kv_cache_takes_the_modules_own_path():
    model = _prepared()
    ids = torch.randint(0, 96, (1, 7))
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        expected = model.generate(ids, **settings)
        fuse_decoder_layers(model)
        assert torch.equal(model.generate(ids, **settings), expected)


def test_unfuse_gives_the_layers_their_own_forward_back():
    model = _prepared()
    fuse_decoder_layers(model)
    assert fuse_decoder_layers(model) == 0  # already fused: nothing wrapped twice
    unfuse_decoder_layers(model)
    assert _fused(model) == []
    assert fuse_decoder_layers(model) == 3


def test_layers_of_another_shape_keep_their_forward():
    model = _prepared()
    model.model.layers[0].self_attn.q_norm = nn.Identity()  # Qwen3-style q/k norms: not the Llama layer
    model.model.layers[1].mlp.register_forward_hook(lambda *args: None)  # a hook would be skipped
    assert fuse_decoder_layers(model) == 1
    assert _fused(model) == [model.model.layers[2]]


@pytest.mark.parametrize("clip_qkv", [None, 1.0])
def test_olmo_layers_that_clamp_q_k_v_keep_their_forward(clip_qkv):
    """OLMo's layer has the Llama layer's shape; with ``clip_qkv`` its attention clamps q, k and v before RoPE,
    which a test input may never reach (the fusing check's q stays under 1) while real activations do."""
    torch.manual_seed(0)
    config = OlmoConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, clip_qkv=clip_qkv)
    model = OlmoForCausalLM(config).eval()
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.self_attn.q_proj.weight[:, 3] = 0.2  # a feature real checkpoints carry outliers in
    register_paged_attention(model)
    pack_cpu_linears(model, batch_invariant=unavailable_reason() is None)
    assert fuse_decoder_layers(model) == (2 if clip_qkv is None else 0)
    x = torch.randn(1, 5, 64)
    x[..., 3] += 400  # the outlier itself: q then passes the clip
    angles = torch.rand(1, 5, 16)
    embeddings = (angles.cos(), angles.sin())
    with torch.inference_mode():
        expected = type(layer).forward(layer, x, attention_mask=None, position_embeddings=embeddings)
        _assert_same(layer(x, attention_mask=None, position_embeddings=embeddings), expected)


def test_unpacked_projections_keep_the_modules_forward():
    model = _tiny_llama()  # q/k/v still plain Linear layers (cpu_linear_kernel: torch, or quantized)
    register_paged_attention(model)
    assert fuse_decoder_layers(model) == 0


class PostNormLayer(LlamaDecoderLayer):
    """Same children, another formula (norm after the residual): the check must refuse the one-frame forward."""

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        attended, _ = self.self_attn(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)
        hidden_states = self.input_layernorm(hidden_states + attended)
        return self.post_attention_layernorm(hidden_states + self.mlp(hidden_states))


def test_a_layer_computing_something_else_keeps_its_forward():
    model = _tiny_llama()
    layer = model.model.layers[1]
    layer.__class__ = PostNormLayer
    register_paged_attention(model)
    pack_cpu_linears(model)
    assert fuse_decoder_layers(model) == 2
    assert "forward" not in layer.__dict__


def test_the_setting_is_checked():
    assert EngineConfig(cpu_decoder_layer="torch").cpu_decoder_layer == "torch"
    with pytest.raises(ValueError, match="cpu_decoder_layer"):
        EngineConfig(cpu_decoder_layer="fast")
