"""The engine on torch's ops alone, as on a CPU where our kernels cannot run (no AVX2, ARM, no compiler):
Linear layers on oneDNN (or torch's own), attention through gather + SDPA, torch's norms, RoPE and argmax.
Runs on every machine (the kernels are turned off), so the fallbacks never go untested."""

import pytest

from app.config import ModelConfig
from app.cpu.linear_kernels import onednn_supported
from app.engine import Request
from app.models import load_model
from tests.model.conftest import PARITY_TOKENS, PROMPTS, greedy, hf_greedy_divergence, make_engine, run_engine

pytestmark = [pytest.mark.model, pytest.mark.cpu_only]


def test_without_the_kernels_every_prompt_still_gives_transformers_greedy_tokens_inside_a_batch(kernels_off, loaded_fp32):
    # the engine's own model: the shared one may hold our GEMM (its copy as transformers built it is the reference)
    own = load_model(ModelConfig(dtype="float32"))
    engine = make_engine(own, max_model_len=512, max_num_batched_tokens=48, max_num_seqs=16)  # prefill in chunks beside decodes
    path = engine.runner.fast_path
    assert path.kernels.startswith("off") and path.attention is None
    assert path.parts["rms_norm"] == "torch" and path.parts["argmax"] == "torch"
    assert path.parts["linear"].startswith("onednn" if onednn_supported() else "torch")
    prompts = [own.tokenizer.encode(p) for p in PROMPTS[:6]]
    # the greedy parity test's prompts and length (tests/model/test_greedy_parity.py)
    requests = [Request(f"fallback-{i}", ids, greedy(PARITY_TOKENS), own.eos_token_ids) for i, ids in enumerate(prompts)]
    outputs = run_engine(engine, requests)
    for request, ids in zip(requests, prompts):
        assert hf_greedy_divergence(loaded_fp32, ids, outputs[request.request_id], PARITY_TOKENS) is None, request.request_id
