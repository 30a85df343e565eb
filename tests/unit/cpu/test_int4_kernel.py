"""Our 4-bit Linear kernel (``linear_int4_bf16dot`` in ``kernels/linear_avx512bf16.c``) on CPUs with avx512_bf16.

It multiplies bf16-rounded activations by GPTQ's codes and applies each group's zero and scale in fp32:
compared with the exactly dequantized weight ((code - zero) * scale) in float64, bit for bit with itself across
batch sizes and thread counts, and read from a real GPTQModel layer in tests/model/test_quantized_models.py.
"""

import pytest
import torch

from app.cpu.int4_kernels import Int4Weights, pack_codes, pack_per_group
from app.cpu.linear_kernels import bf16_products_available
from app.cpu.ops import OPS, unavailable_reason

pytestmark = pytest.mark.skipif(
    not bf16_products_available(),
    reason=f"our int4 kernel needs the CPU kernels and avx512_bf16: {unavailable_reason() or 'this CPU has no avx512_bf16'}",
)


def _layer(n: int, k: int, group_size: int, seed: int):
    torch.manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = (torch.rand(k // group_size, n) * 0.02 + 0.001).half().float()  # GPTQ keeps fp16 scales
    zeros = torch.randint(3, 13, (k // group_size, n)).float()  # asymmetric: a zero per column and group
    return codes, scales, zeros


def _run(x, layer, group_size, bias=None):
    codes, scales, zeros = layer
    return OPS.linear_int4_bf16dot(x, pack_codes(codes), pack_per_group(scales, torch.float16), pack_per_group(zeros, torch.uint8), bias,
                                   codes.shape[0], group_size)


@pytest.mark.parametrize("n, k, group_size, rows", [(1536, 576, 64, 5), (576, 1536, 32, 8), (100, 256, 32, 13),
                                                    (64, 128, 128, 1), (200, 128, 16, 40)])
def test_the_product_is_the_exactly_dequantized_weights_times_bf16_activations(n, k, group_size, rows):
    layer = _layer(n, k, group_size, seed=n + k + rows)
    x, bias = torch.randn(rows, k), torch.randn(n)
    got = _run(x, layer, group_size, bias)
    weight = Int4Weights(*layer, group_size).dequantized().double()
    want = x.bfloat16().double() @ weight.T + bias.double()
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # fp32 sums of exact products, then a zero and a scale per group: a few ulps of the sum of magnitudes
    magnitude = x.bfloat16().double().abs() @ (layer[0].double() + layer[2].repeat_interleave(group_size, 0).T.double()).T
    scale = magnitude * layer[1].max().item()
    assert torch.all((got.double() - want).abs() <= 64 * torch.finfo(torch.float32).eps * scale + 1e-6)


def test_a_row_has_the_same_bits_alone_in_any_batch_and_on_any_thread_count():
    layer = _layer(576, 1536, 32, seed=1)
    x = torch.randn(40, 1536)
    batch = _run(x, layer, 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single_thread = _run(x[:17], layer, 32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single_thread, batch[:17])
    for i in (0, 5, 6, 39):
        assert torch.equal(_run(x[i:i + 1], layer, 32), batch[i:i + 1])


def test_bf16_activations_give_bf16_outputs_of_the_same_product():
    layer = _layer(128, 256, 64, seed=2)
    x = torch.randn(3, 256).bfloat16()
    got = _run(x, layer, 64)
    assert got.dtype == torch.bfloat16 and torch.equal(got, _run(x.float(), layer, 64).bfloat16())


def test_inconsistent_shapes_are_refused_with_the_reason():
    codes, scales, zeros = _layer(64, 128, 64, seed=3)
    with pytest.raises(RuntimeError, match="group_size must be a multiple of 16"):
        OPS.linear_int4_bf16dot(torch.randn(2, 128), pack_codes(codes), pack_per_group(scales, torch.float16), pack_per_group(zeros, torch.uint8),
                                None, 64, 48)
    with pytest.raises(RuntimeError, match="codes hold no"):
        OPS.linear_int4_bf16dot(torch.randn(2, 128), pack_codes(codes), pack_per_group(scales, torch.float16), pack_per_group(zeros, torch.uint8),
                                None, 128, 64)
