import pytest
import torch
from torch import nn

from app.cpu.linear import PackedLinear, PackedSiblingLinear, pack_cpu_linears
from tests.unit.cpu.conftest import needs_kernels


class QuantizedLinearStandIn(nn.Linear):
    """A Linear subclass, as quantized layers are: must be left as loaded."""


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 32, bias=False),
        QuantizedLinearStandIn(32, 32), nn.Linear(32, 16).to(torch.bfloat16),
    )


def test_packs_only_plain_fp32_linears():
    model = _model()
    assert pack_cpu_linears(model) == 2
    assert [type(m) for m in model] == [PackedLinear, nn.SiLU, PackedLinear, QuantizedLinearStandIn, nn.Linear]
    assert pack_cpu_linears(model) == 0  # a second runner over the same weights packs nothing again


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 200])
def test_packed_outputs_match_dense_for_any_row_count(rows):
    dense = _model()[:3]
    packed = _model()[:3]
    pack_cpu_linears(packed)
    x = torch.randn(1, rows, 64)  # [batch, tokens, features], as transformers calls Linear layers
    with torch.inference_mode():
        expected, got = dense(x), packed(x)
    assert got.shape == expected.shape == (1, rows, 32)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_packing_keeps_tied_parameters_tied_and_their_values():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Embedding(10, 8), nn.Linear(8, 8))
    model[1].weight = model[0].weight  # tied, as input and output embeddings often are
    before = model[0].weight.detach().clone()
    pack_cpu_linears(model)
    assert model[1].weight is model[0].weight
    assert torch.equal(model[0].weight, before)


class AttentionProjections(nn.Module):
    """The projections of a transformers attention + MLP block, with their usual names."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(64, 96, bias=bias), nn.Linear(64, 32, bias=bias), nn.Linear(64, 32, bias=bias)
        self.gate_proj, self.up_proj = nn.Linear(64, 128, bias=bias), nn.Linear(64, 128, bias=bias)

    def forward(self, x: torch.Tensor, order: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return {name: getattr(self, name)(x) for name in order}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_sibling_projections_run_as_one_gemm_with_the_dense_results(bias, rows):
    torch.manual_seed(0)
    dense = AttentionProjections(bias)
    fused = AttentionProjections(bias)
    fused.load_state_dict(dense.state_dict())
    assert pack_cpu_linears(fused) == 5
    assert all(type(m) is PackedSiblingLinear for m in fused.children())
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        expected = dense(x)
        for order in [("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("v_proj", "up_proj", "q_proj", "gate_proj", "k_proj")]:
            got = fused(x, order)
            for name in order:
                torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)


def test_a_sibling_called_on_a_new_input_computes_for_that_input():
    torch.manual_seed(0)
    dense, fused = AttentionProjections(), AttentionProjections()
    fused.load_state_dict(dense.state_dict())
    pack_cpu_linears(fused)
    a, b = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    with torch.inference_mode():
        fused.q_proj(a)  # leaves k and v of `a` unread
        torch.testing.assert_close(fused.k_proj(b), dense.k_proj(b), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fused.k_proj(b), dense.k_proj(b), rtol=1e-4, atol=1e-5)  # read twice: recomputed
        torch.testing.assert_close(fused.v_proj(a), dense.v_proj(a), rtol=1e-4, atol=1e-5)


def test_siblings_are_fused_only_when_all_are_plain_fp32_linears_of_one_input():
    model = AttentionProjections()
    model.v_proj = QuantizedLinearStandIn(64, 32)  # a quantized sibling: q/k/v stay separate
    model.up_proj = nn.Linear(64, 128, bias=True)  # gate has no bias, up has one: separate
    assert pack_cpu_linears(model) == 4
    assert [type(m) for m in model.children()] == [PackedLinear, PackedLinear, QuantizedLinearStandIn, PackedLinear, PackedLinear]


def _llama_mlp(act_on_up: bool = False) -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    class ActOnUpMLP(LlamaMLP):
        """Another gated formula under the same names: act(up) * gate."""

        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, hidden_act="silu")
    return (ActOnUpMLP if act_on_up else LlamaMLP)(config).eval()


@pytest.mark.parametrize("rows", [1, 7, 32])
def test_a_gated_mlp_runs_on_its_shared_gemm_with_the_same_bits(rows):
    from app.cpu.linear import GatedMLPForward

    model = _llama_mlp()
    x = torch.randn(1, rows, 64)
    pack_cpu_linears(model)
    assert isinstance(model.__dict__.get("forward"), GatedMLPForward)
    with torch.inference_mode():
        got = model(x)
        model.__dict__.pop("forward")  # the module's own forward over the same packed projections
        assert torch.equal(got, model(x))


def test_a_gated_mlp_with_another_formula_keeps_its_own_forward():
    model = _llama_mlp(act_on_up=True)
    pack_cpu_linears(model)
    assert isinstance(model.gate_proj, PackedSiblingLinear) and "forward" not in model.__dict__


@needs_kernels
def test_a_gated_mlp_with_silu_takes_the_one_call_activation_where_the_kernels_run():
    from app.cpu.linear import GatedMLPForward

    model = _llama_mlp()
    pack_cpu_linears(model)
    fused = model.__dict__.get("forward")
    assert isinstance(fused, GatedMLPForward) and fused.silu_lanes is not None


@pytest.mark.parametrize("rows", [1, 32])
def test_a_gated_mlp_adds_its_residual_with_the_bits_of_adding_it_after(rows):
    model = _llama_mlp()
    pack_cpu_linears(model)
    x, residual = torch.randn(1, rows, 64), torch.randn(1, rows, 64)
    with torch.inference_mode():
        assert torch.equal(model.__dict__["forward"].add(x, residual), residual + model(x))


def test_a_kernel_that_computes_wrongly_is_not_installed_and_the_log_says_so(monkeypatch, caplog):
    """The load-time parity check compares the model, kernels installed, with itself: each kernel is checked against
    the weight it packed as it is installed, and a wrong one leaves torch's layers of that shape."""
    import logging

    from app.cpu.linear_kernels import select_kernel

    kernel = select_kernel("auto")  # what this CPU runs by name: ours, else oneDNN's
    if kernel is None:
        pytest.skip("no Linear kernel runs on this CPU and torch build: nothing is packed")
    right = type(kernel).apply
    monkeypatch.setattr(type(kernel), "apply", lambda self, x, packed, bias, n: right(self, x, packed, bias, n) * 3.0)
    model = _model()
    with caplog.at_level(logging.ERROR, logger="app.cpu.linear"):
        assert pack_cpu_linears(model, kernel.name) == 0
    assert [type(m) for m in model][:3] == [nn.Linear, nn.SiLU, nn.Linear]
    assert f"Linear kernel {kernel.name} computes a 96 x 64 layer" in caplog.text and "torch's kept" in caplog.text
    monkeypatch.setattr(type(kernel), "apply", right)
    assert pack_cpu_linears(_model(), kernel.name) == 2  # as it is, it computes them
