"""The gated MLP's one-call ``silu(gate) * up`` (kernels/silu_mul.c): torch's bits for every value, row and width."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.cpu.activation import silu_mul, silu_mul_lanes
from tests.unit.cpu.conftest import loaded_ops, needs_kernels

pytestmark = needs_kernels


def _torch(gate_up: torch.Tensor) -> torch.Tensor:
    width = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :width]) * gate_up[..., width:]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _lanes() -> int:
    loaded_ops()
    lanes = silu_mul_lanes(nn.SiLU())
    assert lanes is not None, f"torch's CPU capability {torch.backends.cpu.get_cpu_capability()} has no known width"
    return lanes


# widths with every remainder torch's loop leaves to scalar code (pairs of 16- or 8-wide vectors)
@pytest.mark.parametrize("width", [1, 7, 8, 15, 16, 17, 31, 32, 33, 47, 100, 1536, 2816])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_silu_mul_gives_torchs_bits(width, rows):
    generator = torch.Generator().manual_seed(width * 100 + rows)
    gate_up = torch.randn(rows, 2 * width, generator=generator) * 8
    assert _same_bits(silu_mul(gate_up, _lanes()), _torch(gate_up))


def test_silu_mul_gives_torchs_bits_on_any_float_including_inf_nan_and_subnormals():
    generator = torch.Generator().manual_seed(1)
    bits = torch.randint(-2**31, 2**31 - 1, (4, 2 * 4096), dtype=torch.int32, generator=generator)
    gate_up = bits.view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 88.7, -88.7, 1e-40, -1e-40, 100.0, -104.0])
    gate_up[0, :special.numel()] = special
    gate_up[1, 4096:4096 + special.numel()] = special
    got, want = silu_mul(gate_up, _lanes()), _torch(gate_up)
    assert torch.equal(got.isnan(), want.isnan())
    assert _same_bits(got[~got.isnan()], want[~want.isnan()])


def test_a_row_has_the_same_bits_alone_and_in_a_batch_of_any_size():
    generator = torch.Generator().manual_seed(2)
    batch = torch.randn(300, 2 * 1000, generator=generator) * 4  # 300 x 1000: threads split the rows
    together = silu_mul(batch, _lanes())
    for i in (0, 1, 149, 150, 299):
        assert _same_bits(silu_mul(batch[i:i + 1], _lanes()), together[i:i + 1])


def test_leading_dimensions_are_kept_and_bad_inputs_are_errors():
    gate_up = torch.randn(2, 5, 2 * 24)
    assert silu_mul(gate_up, _lanes()).shape == (2, 5, 24)
    with pytest.raises(RuntimeError, match="even"):
        silu_mul(torch.randn(3, 7), _lanes())
    with pytest.raises(RuntimeError, match="lanes"):
        silu_mul(gate_up, 4)
    with pytest.raises(RuntimeError, match="Float"):
        silu_mul(gate_up.double(), _lanes())


def test_only_silu_gets_the_kernel():
    from transformers.activations import ACT2FN

    _lanes()
    assert silu_mul_lanes(ACT2FN["silu"]) is not None
    assert silu_mul_lanes(nn.GELU()) is None
    assert silu_mul_lanes(ACT2FN["gelu_pytorch_tanh"]) is None
