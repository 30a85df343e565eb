"""Our bf16 Linear kernel (``kernels/linear_avx512bf16.c``, ``vdpbf16ps``) against torch, on CPUs with avx512_bf16.

The kernel multiplies bf16-rounded activations and weights and sums in fp32: compared with the same rounded
values multiplied in float64 (only fp32 summation separates them), and bit for bit with itself across batch
sizes and thread counts, since each output is summed in one fixed order.
"""

import pytest
import torch

from app.cpu.linear_kernels import AVX512BF16Kernel, bf16_products_available, cpu_has_avx512_bf16, select_kernel
from app.cpu.ops import unavailable_reason

pytestmark = pytest.mark.skipif(
    not bf16_products_available(),
    reason=f"our bf16 kernel needs the CPU kernels and avx512_bf16: {unavailable_reason() or 'this CPU has no avx512_bf16'}",
)


def _reference(x, weight, bias):
    exact = torch.nn.functional.linear(x.bfloat16().double(), weight.bfloat16().double())
    return (exact + bias.double() if bias is not None else exact).float()


@pytest.mark.parametrize("n, k, rows", [(96, 64, 5), (960, 576, 1), (50, 33, 7), (576, 1536, 32), (130, 2, 13), (200, 66, 25), (300, 64, 20)])
def test_the_product_is_the_bf16_rounded_product_summed_in_fp32(n, k, rows):
    torch.manual_seed(n + k + rows)
    weight, bias, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    kernel = AVX512BF16Kernel()
    got = kernel.apply(x, kernel.pack(weight), bias, n)
    want = _reference(x, weight, bias)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # fp32 sums of k exact products: error within k ulps of the largest partial sum
    scale = (x.bfloat16().double().abs() @ weight.bfloat16().double().abs().T).float()
    assert torch.all((got - want).abs() <= 2 * k * torch.finfo(torch.float32).eps * scale + 1e-6)
    no_bias = kernel.apply(x, kernel.pack(weight), None, n)
    assert torch.allclose(no_bias + bias, got, atol=1e-4)


@pytest.mark.parametrize("k", [33, 576])
def test_activations_are_rounded_to_bf16_exactly_as_torch_rounds_them(k):
    """The kernel rounds x to bf16 itself: through an identity weight each output is that rounding, which must be
    torch's value for value: exact ties (to even), ties that carry into the exponent, either sign, an odd k's pad."""
    generator = torch.Generator().manual_seed(k)
    bits = torch.randint(-(2**31), 2**31 - 1, (64, k), generator=generator, dtype=torch.int64)
    bits = (bits & ~(0xFF << 23)) | ((bits.abs() % 160 + 48) << 23)  # exponents 2^-79 .. 2^80: no denormals, no overflow
    bits[::2] = (bits[::2] & ~0xFFFF) | 0x8000  # every other row exactly halfway between two bf16 values
    bits[1::4] |= 0x7FFF  # and some just below halfway, or carrying into the exponent once tied
    x = bits.to(torch.int32).view(torch.float32)
    kernel = AVX512BF16Kernel()
    got = kernel.apply(x, kernel.pack(torch.eye(k)), None, k)
    assert torch.equal(got, x.bfloat16().float())


def test_a_row_has_the_same_bits_alone_in_any_batch_and_on_any_thread_count():
    torch.manual_seed(0)
    weight, x = torch.randn(1000, 576), torch.randn(37, 576, dtype=torch.float32)
    kernel = AVX512BF16Kernel()
    packed = kernel.pack(weight)
    batch = kernel.apply(x, packed, None, 1000)
    assert all(torch.equal(kernel.apply(x[i : i + 1], packed, None, 1000)[0], batch[i]) for i in range(37))
    assert torch.equal(kernel.apply(x[5:20], packed, None, 1000), batch[5:20])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel.apply(x, packed, None, 1000), batch)
    finally:
        torch.set_num_threads(threads)


def test_shapes_the_kernel_cannot_take_are_errors_not_reads():
    kernel = AVX512BF16Kernel()
    packed = kernel.pack(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="packed holds no"):
        kernel.apply(torch.randn(2, 30), packed, None, 64)
    with pytest.raises(RuntimeError, match="bias must have"):
        kernel.apply(torch.randn(2, 32), packed, torch.randn(63), 64)


def test_asking_for_it_by_name_works_here_and_names_the_kernel():
    assert cpu_has_avx512_bf16()
    assert isinstance(select_kernel("avx512-bf16"), AVX512BF16Kernel)
    assert isinstance(select_kernel("auto", torch.bfloat16, bf16_products=True), AVX512BF16Kernel)
    assert select_kernel("auto").name == "avx2"  # fp32 stays fp32


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n, k, rows", [(96, 64, 5), (50, 33, 7), (576, 1536, 32), (300, 64, 40)])
def test_a_residual_summed_as_outputs_are_stored_gives_the_bits_of_adding_it_after(bias, n, k, rows):
    from app.cpu.linear_kernels import apply_add

    torch.manual_seed(n + rows)
    weight, x, residual = torch.randn(n, k), torch.randn(rows, k), torch.randn(rows, n) * 10
    b = torch.randn(n) if bias else None
    kernel = AVX512BF16Kernel()
    packed = kernel.pack(weight)
    got = apply_add(kernel, x, packed, b, n, residual)
    assert torch.equal(got, residual + kernel.apply(x, packed, b, n))
    assert not torch.equal(got, kernel.apply(x, packed, b, n))
    with pytest.raises(RuntimeError, match="residual must have the output's shape"):
        torch.ops.llm_serve.linear_bf16dot(x, packed, b, n, residual[:, :-1].contiguous())


def test_activations_are_rounded_to_bf16_as_torch_rounds_them():
    # an identity weight returns each activation as the kernel rounded it (subnormal products aside: vdpbf16ps
    # flushes them), whatever its exponent and whether it is a row's last, odd feature
    generator = torch.Generator().manual_seed(0)
    for k in (64, 33):
        x = torch.randn(512, k, generator=generator) * torch.exp2(torch.randint(-120, 100, (512, k), generator=generator).float())
        kernel = AVX512BF16Kernel()
        got = kernel.apply(x, kernel.pack(torch.eye(k)), None, k)
        want = x.bfloat16().float()
        normal = want.abs() >= torch.finfo(torch.float32).tiny
        assert normal.sum() > 0.9 * x.numel() and torch.equal(got[normal], want[normal])
