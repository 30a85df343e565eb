"""The GPTQ 4-bit kernels (``app/cpu/int4_kernels.py``) and their choice per row bucket (``app/cpu/gptq.py``): every
kernel against the exactly dequantized weight on every bucket's row count, the rebuilt weight exact, and ``auto``
routing row counts as the bake-off decides (fake timings) or keeping GPTQModel's layers where it must."""

import pytest
import torch

from app.cpu import kernel_choice
from app.cpu.gptq import Int4Linear, choose_int4_kernels
from app.cpu.int4_kernels import DequantKernel, Int4Weights, TorchInt4Kernel, available_int4_kernels, dequantize
from app.cpu.kernel_choice import BUCKETS
from app.cpu.linear_kernels import RowBucketKernel

ALL = ("int4-avx512-bf16", "torch-int4", "dequant-fp32", "dequant-bf16")
# Relative to the largest output: each rounds activations to bf16 (in the reference too); torch's op also rounds the
# scales and its outputs to bf16, dequant-bf16 the weight (2^-9 each, over sums that partly cancel).
TOLERANCE = {"int4-avx512-bf16": 1e-5, "dequant-fp32": 1e-5, "torch-int4": 1.5e-2, "dequant-bf16": 1.5e-2}


def _weights(n: int, k: int, group_size: int, seed: int) -> Int4Weights:
    torch.manual_seed(seed)
    return Int4Weights.from_dense(torch.randn(n, k), group_size)


def _kernel(name: str):
    kernel = available_int4_kernels().get(name)
    if kernel is None:
        pytest.skip(f"{name} does not run on this CPU or torch build")
    return kernel


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("n, k, group_size", [(192, 576, 32), (100, 256, 64)])  # 100: not a whole block of 16
def test_every_kernel_computes_the_dequantized_weight_on_every_bucket(name, n, k, group_size):
    kernel = _kernel(name)
    weights = _weights(n, k, group_size, seed=n + k)
    layer = Int4Linear(weights, torch.randn(n), kernel)
    exact = weights.dequantized().double()
    for bucket in BUCKETS:
        x = torch.randn(2, bucket.timed, k)  # a batch dimension too, as transformers' modules call it
        got = layer(x)
        want = x.bfloat16().double() @ exact.T + layer.bias.double()
        assert got.shape == (2, bucket.timed, n) and got.dtype == torch.float32
        assert (got.double() - want).abs().max() <= TOLERANCE[name] * want.abs().max(), (name, bucket)


@pytest.mark.parametrize("name", ["dequant-fp32", "dequant-bf16"])
def test_a_large_layer_is_rebuilt_a_tile_of_columns_at_a_time_with_the_same_result(name, monkeypatch):
    kernel = _kernel(name)
    weights = _weights(100, 128, 32, seed=6)
    layer = Int4Linear(weights, torch.randn(100), kernel)
    x = torch.randn(3, 70, 128)
    whole = layer(x)
    monkeypatch.setattr("app.cpu.int4_kernels.TILE_BYTES", 32 * 128 * 4)  # 32 columns a tile: 4 tiles, the last short
    tiled = layer(x)
    assert tiled.shape == (3, 70, 100)
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-5)  # MKL may block a narrower product differently


def test_a_layer_holds_its_packed_codes_as_buffers_so_the_models_memory_counts_them():
    from app.models.quantization import quantized_linear_bytes

    layer = Int4Linear(_weights(64, 128, 32, seed=7), None, DequantKernel(torch.float32))
    stored, bf16 = quantized_linear_bytes(torch.nn.Sequential(layer))
    assert bf16 == 64 * 128 * 2 and stored == 64 * 128 // 2 + 64 * 4 * 3  # nibbles, fp16 scales and zero codes


def test_the_rebuilt_weight_is_the_checkpoints_bit_for_bit():
    weights = _weights(160, 512, 32, seed=3)
    assert torch.equal(dequantize(*DequantKernel(torch.float32).pack(weights)), weights.dequantized())


def test_codes_from_a_dense_weight_reproduce_it_to_half_a_step():
    torch.manual_seed(4)
    dense = torch.randn(64, 128)
    weights = Int4Weights.from_dense(dense, 32)
    step = weights.scales.t().repeat_interleave(32, dim=1)  # [out, in]
    assert weights.codes.max() <= 15 and torch.all((weights.dequantized() - dense).abs() <= step * 0.51 + 1e-6)


def test_torch_int4_pads_its_columns_and_keeps_the_checkpoints_zeros():
    weights = _weights(40, 64, 32, seed=5)  # 40 columns: the op takes blocks of 16
    x = torch.randn(3, 64)
    got = Int4Linear(weights, None, _kernel("torch-int4"))(x)
    assert got.shape == (3, 40)
    assert (got - x.bfloat16().float() @ weights.dequantized().T).abs().max() < 1.5e-2 * got.abs().max()


def test_auto_routes_each_row_count_to_the_kernel_its_bucket_chose(monkeypatch):
    kernels = {"torch-int4": TorchInt4Kernel(), "dequant-fp32": DequantKernel(torch.float32)}
    monkeypatch.setattr("app.cpu.gptq.available_int4_kernels", lambda: kernels)
    split = {"1": "torch-int4", "2-8": "torch-int4", "9-64": "torch-int4", "65+": "dequant-fp32"}
    seen = []
    monkeypatch.setattr(kernel_choice, "choose", lambda shapes, timed, incumbent, family, build:
                        seen.append((incumbent, family, [s.weight_bytes for s in shapes])) or {s.key: split for s in shapes})
    chosen = choose_int4_kernels("auto", False, [(64, 128, 32), (32, 128, 64)])
    assert sorted(seen) == [("torch-int4", "gptq-int4 group 32", [0.5]), ("torch-int4", "gptq-int4 group 64", [0.5])]
    kernel = chosen[(64, 128, 32)]
    assert isinstance(kernel, RowBucketKernel) and kernel.name == "torch-int4 1-64 rows / dequant-fp32 65+ rows"
    used = []
    for inner in kernel.kernels:
        monkeypatch.setattr(inner, "apply", lambda x, *args, name=inner.name: used.append((name, x.shape[0])))
    for rows in (1, 64, 65, 300):
        kernel.apply(torch.zeros(rows, 128), (None, None), None, 64)
    assert used == [("torch-int4", 1), ("torch-int4", 64), ("dequant-fp32", 65), ("dequant-fp32", 300)]


def test_batch_invariant_takes_only_a_fixed_order_kernel(monkeypatch):
    kernels = {"torch-int4": TorchInt4Kernel(), "dequant-fp32": DequantKernel(torch.float32)}
    monkeypatch.setattr("app.cpu.gptq.available_int4_kernels", lambda: kernels)
    assert choose_int4_kernels("auto", True, [(64, 128, 32)]) is None  # GPTQModel's layers stay
    with pytest.raises(ValueError, match="batch_invariant needs a fixed-order kernel"):
        choose_int4_kernels("dequant-fp32", True, [(64, 128, 32)])
    assert choose_int4_kernels("dequant-fp32", False, [(64, 128, 32)]) == {(64, 128, 32): kernels["dequant-fp32"]}


def test_a_kernel_this_cpu_lacks_is_refused_with_what_it_runs(monkeypatch):
    monkeypatch.setattr("app.cpu.gptq.available_int4_kernels", lambda: {"dequant-fp32": DequantKernel(torch.float32)})
    with pytest.raises(ValueError, match="does not run.*it runs: auto, torch, dequant-fp32"):
        choose_int4_kernels("int4-avx512-bf16", False, [(64, 128, 32)])


def test_a_group_size_torchs_op_does_not_take_is_never_given_to_it(monkeypatch):
    """torch's int4 op takes groups of 32-256: a checkpoint's 16, 48 or 96 go to the kernels that take any, whether
    asked for by name (refused at load, not at the first forward) or chosen by ``auto``."""
    kernels = {"torch-int4": TorchInt4Kernel(), "dequant-fp32": DequantKernel(torch.float32)}
    monkeypatch.setattr("app.cpu.gptq.available_int4_kernels", lambda: kernels)
    with pytest.raises(ValueError, match="does not take this checkpoint's group size 48"):
        choose_int4_kernels("torch-int4", False, [(64, 96, 48)])
    timed = []
    monkeypatch.setattr(kernel_choice, "choose", lambda shapes, candidates, incumbent, family, build:
                        timed.append((sorted(candidates), incumbent)) or {s.key: dict.fromkeys((b.name for b in BUCKETS), incumbent)
                                                                           for s in shapes})
    chosen = choose_int4_kernels("auto", False, [(64, 96, 48), (64, 128, 32)])
    assert timed == [(["dequant-fp32", "torch-int4"], "torch-int4"), (["dequant-fp32"], "dequant-fp32")]
    assert chosen[(64, 96, 48)] is kernels["dequant-fp32"] and chosen[(64, 128, 32)] is kernels["torch-int4"]
