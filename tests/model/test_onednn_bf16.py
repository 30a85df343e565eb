"""``engine.cpu_linear_kernel: onednn-bf16``: oneDNN's bf16 products, opt-in for CPUs with avx512_bf16.

It computes another model numerically (activations rounded to bf16 at each Linear) and oneDNN sums a row
differently with the rows beside it, so neither the fp32 path's bits nor the engine's bit-exact batching hold:
the product is checked against the same bf16-rounded product in fp32, and the model's greedy tokens against
the fp32 path's, which they may leave only where two candidates were within bf16 rounding of each other.
"""

import pytest
import torch

from app.config import ModelConfig
from app.cpu.linear_kernels import OneDNNBF16Kernel, onednn_bf16_supported, select_kernel
from app.engine import Request
from app.models.loader import load_model
from tests.model.conftest import PROMPTS, greedy, make_engine, run_engine

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.skipif(not onednn_bf16_supported(),
                       reason="oneDNN has no bf16 path on this CPU (avx512bw/vl/dq or avx_ne_convert) or torch build"),
]


def test_the_product_is_the_bf16_rounded_product_with_fp32_sums_and_the_bias_added():
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(5, 64)
    kernel = select_kernel("onednn-bf16")
    assert isinstance(kernel, OneDNNBF16Kernel)
    got = kernel.apply(x, kernel.pack(weight), bias, 96)
    rounded = torch.nn.functional.linear(x.bfloat16().float(), weight.bfloat16().float())
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    # the bf16 result is rounded once more: within bf16's half-ulp of the exact sum (plus fp32 summation order)
    assert torch.allclose(got - bias, rounded, rtol=2 ** -8, atol=1e-3)
    assert not torch.allclose(got, torch.nn.functional.linear(x, weight, bias), rtol=0, atol=1e-5)  # not fp32's


@pytest.mark.model
def test_the_model_on_onednn_bf16_keeps_the_fp32_paths_greedy_tokens_but_where_bf16_rounding_decides(loaded_fp32):
    own = load_model(ModelConfig(dtype="float32"))  # its own copy: packing replaces the Linear layers in place
    # oneDNN sums a row by its batch, so the engine cannot run it in the batch-invariant mode the helper defaults to
    engine = make_engine(own, max_model_len=512, cpu_linear_kernel="onednn-bf16", batch_invariant=False)
    assert engine.runner.fast_path.parts["linear"].startswith("onednn-bf16")
    prompts = [own.tokenizer.encode(p) for p in PROMPTS[:8]]
    requests = lambda tag: [Request(f"{tag}-{i}", ids, greedy(12), own.eos_token_ids) for i, ids in enumerate(prompts)]
    bf16 = run_engine(engine, requests("bf16"))
    fp32 = run_engine(make_engine(loaded_fp32, max_model_len=512), requests("fp32"))
    same_prefix = [_common_prefix(bf16[f"bf16-{i}"], fp32[f"fp32-{i}"]) for i in range(len(prompts))]
    assert all(len(bf16[f"bf16-{i}"]) == 12 for i in range(len(prompts)))
    # the first token of every prompt, and most of the 96 before a near tie sends a continuation its own way
    # (measured: 12, 12, 12, 12, 9, 4, 3, 12); a wrong product leaves nothing in common
    assert min(same_prefix) >= 1 and sum(same_prefix) >= 48, same_prefix


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
