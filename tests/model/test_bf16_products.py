"""bf16 on a CPU with avx512_bf16 where our kernels run (what ``dtype: auto`` and ``bfloat16`` load there): Linear
layers on our bf16 kernel and a bf16 KV cache, everything else fp32.

A request's tokens and logprobs are the same bits alone and inside a batch that prefills in chunks beside
other requests' decodes (the kernel sums each output in one order); greedy tokens keep the fp32 model's but
where bf16 rounding decides between two near-equal candidates.
"""

import pytest
import torch

from app.config import ModelConfig
from app.cpu.linear_kernels import bf16_products_available
from app.cpu.ops import unavailable_reason
from app.engine import Request, SamplingParams
from app.models.loader import load_model
from tests.model.conftest import PROMPTS, greedy, make_engine, run_engine

pytestmark = [
    pytest.mark.model,
    pytest.mark.cpu_only,
    pytest.mark.skipif(not bf16_products_available(),
                       reason=f"needs our kernels and avx512_bf16: {unavailable_reason() or 'this CPU has no avx512_bf16'}"),
]


@pytest.fixture(scope="module")
def loaded():
    return load_model(ModelConfig(dtype="auto"))


def _logprobs(engine, prompts: dict[str, list[int]], eos) -> dict[str, list[tuple]]:
    sampling = SamplingParams(max_tokens=8, min_tokens=8, temperature=0, logprobs=2)
    seen = {rid: [] for rid in prompts}
    engine.add_requests([Request(rid, ids, sampling, eos) for rid, ids in prompts.items()])
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id] += [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in output.logprobs or []]
    return seen


def test_auto_and_bfloat16_load_the_bf16_kernel_path(loaded):
    assert (loaded.dtype, loaded.weight_dtype, loaded.bf16_products) == (torch.float32, torch.bfloat16, True)
    engine = make_engine(loaded, max_model_len=512)
    assert engine.runner.fast_path.parts["linear"].startswith("avx512-bf16")
    assert engine.runner.fast_path.attention is not None  # our attention kernel, over a bf16 KV cache
    assert engine.runner.kv_pool.dtype == torch.bfloat16 and engine.runner.fast_path.parts["KV cache"] == "bfloat16"
    assert make_engine(loaded, max_model_len=512, kv_cache_dtype="float32").runner.kv_pool.dtype == torch.float32
    assert not load_model(ModelConfig(dtype="float32")).bf16_products  # fp32 asked for is fp32


def test_a_request_has_the_same_bits_alone_and_in_a_chunked_batch(loaded):
    prompts = {f"p{i}": loaded.tokenizer.encode(p) for i, p in enumerate(PROMPTS[:8])}
    together = _logprobs(make_engine(loaded, max_model_len=512, enable_prefix_caching=False, max_num_batched_tokens=48, max_num_seqs=16),
                         prompts, loaded.eos_token_ids)
    engine = make_engine(loaded, max_model_len=512, enable_prefix_caching=False)
    for rid, ids in prompts.items():
        alone = _logprobs(engine, {rid: ids}, loaded.eos_token_ids)[rid]
        assert len(alone) == 8 and together[rid] == alone, rid


def test_greedy_tokens_keep_the_fp32_models_but_at_near_ties(loaded, loaded_fp32):
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:8]]
    requests = lambda tag: [Request(f"{tag}-{i}", ids, greedy(12), loaded.eos_token_ids) for i, ids in enumerate(prompts)]
    bf16 = run_engine(make_engine(loaded, max_model_len=512), requests("bf16"))
    fp32 = run_engine(make_engine(loaded_fp32, max_model_len=512), requests("fp32"))
    same = [_common_prefix(bf16[f"bf16-{i}"], fp32[f"fp32-{i}"]) for i in range(len(prompts))]
    print("greedy tokens in common with fp32, of 12:", same)
    assert min(same) >= 1 and sum(same) >= 48, same  # a wrong product leaves nothing in common


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
