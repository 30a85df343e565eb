import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from app.cpu.norm import FusedRMSNormForward, fuse_rms_norms, rms_norm as KERNEL
from tests.unit.cpu.conftest import loaded_ops, needs_kernels

pytestmark = needs_kernels


@pytest.fixture(autouse=True, scope="module")
def _built():
    loaded_ops()  # this machine supports the kernels: a failed build fails every test below


class GemmaStyleRMSNorm(nn.Module):
    """Scales by (1 + weight), as Gemma does: our kernel must not take it over."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).float()


@pytest.mark.parametrize("hidden", [1, 7, 8, 15, 16, 17, 576, 1000])
@pytest.mark.parametrize("rows", [1, 3, 70])  # 70: the multi-threaded path
def test_matches_a_float64_reference_for_every_width(hidden, rows):
    x = torch.randn(rows, hidden) * 4
    weight = torch.randn(hidden)
    torch.testing.assert_close(KERNEL(x, weight, 1e-5), _reference(x, weight, 1e-5), rtol=2e-6, atol=2e-6)


def test_reads_strided_rows_and_keeps_the_input_shape():
    base = torch.randn(2, 5, 48)
    x = base[..., :32]  # rows 48 floats apart
    weight = torch.randn(32)
    out = KERNEL(x, weight, 1e-6)
    assert out.shape == (2, 5, 32)
    torch.testing.assert_close(out, _reference(x, weight, 1e-6), rtol=2e-6, atol=2e-6)


def test_a_row_gives_the_same_bits_alone_in_any_batch_on_any_thread_count():
    weight = torch.randn(576)
    batch = torch.randn(100, 576)
    alone = KERNEL(batch[37:38], weight, 1e-5)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(KERNEL(batch, weight, 1e-5)[37:38], alone)
    finally:
        torch.set_num_threads(threads)


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config).eval()
    for module in model.modules():
        if isinstance(module, LlamaRMSNorm):
            nn.init.normal_(module.weight, 1.0, 0.2)  # not all ones: the weight must be applied
    return model


def test_fuses_every_llama_norm_and_the_model_output_stays():
    model = _tiny_llama()
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        expected = model(ids).logits
        assert fuse_rms_norms(model) == 5  # 2 per layer + the final norm
        got = model(ids).logits
    assert all(isinstance(m.forward, FusedRMSNormForward) for m in model.modules() if isinstance(m, LlamaRMSNorm))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert fuse_rms_norms(model) == 0  # a second runner over the same model replaces nothing again
    assert "model.norm.weight" in dict(model.named_parameters())  # names and weights stay as loaded


def test_a_norm_with_another_formula_keeps_its_own_forward():
    norm = GemmaStyleRMSNorm(16)
    model = nn.Sequential(norm, LlamaRMSNorm(16))
    assert fuse_rms_norms(model) == 1
    assert "forward" not in norm.__dict__


def test_inputs_that_are_not_fp32_take_the_modules_own_path():
    norm = LlamaRMSNorm(16)
    nn.init.normal_(norm.weight)
    fuse_rms_norms(norm)
    x = torch.randn(3, 16, dtype=torch.float64)
    out = norm(x)
    assert out.dtype == torch.float64  # the kernel would have returned fp32
    torch.testing.assert_close(out, LlamaRMSNorm.forward(norm, x))


def test_bf16_norms_are_left_alone():
    norm = LlamaRMSNorm(16).to(torch.bfloat16)
    assert fuse_rms_norms(norm) == 0
