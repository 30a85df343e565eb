import pytest
import torch
from torch import nn

from app.engine.cpu_linear import PackedLinear, pack_cpu_linears


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
