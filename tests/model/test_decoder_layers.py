"""The one-frame decoder layer forward on the real model: every logprob keeps its bits, in prefill chunks and batches."""

import pytest

from app.cpu.decoder import DecoderLayerForward
from app.engine import Request

from tests.model.conftest import PROMPTS, greedy, make_engine, our_kernels_compute

pytestmark = [pytest.mark.model, pytest.mark.cpu_only]  # the fused layer is the CPU path's forward


def _run(loaded, setting: str) -> dict[str, list[tuple[int, float, list]]]:
    engine = make_engine(loaded, max_num_batched_tokens=48, max_num_seqs=16, cpu_decoder_layer=setting)  # 48: long prompts prefill in chunks
    fused = sum(isinstance(m.__dict__.get("forward"), DecoderLayerForward) for m in loaded.model.modules())
    assert fused == (loaded.model.config.num_hidden_layers if setting == "auto" else 0)
    requests = [Request(f"r{i}", loaded.tokenizer.encode(p), greedy(10, logprobs=3)) for i, p in enumerate(PROMPTS)]
    engine.add_requests(requests)
    logprobs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs.setdefault(out.request_id, []).extend((lp.token_id, lp.logprob, lp.top) for lp in out.logprobs)
    return logprobs


def test_fused_layers_keep_every_logprob_bit(loaded_rounded):
    module_path, fused_path = _run(loaded_rounded, "torch"), _run(loaded_rounded, "auto")
    assert len(fused_path) == len(PROMPTS) and all(len(v) == 10 for v in fused_path.values())
    if our_kernels_compute():  # our kernels: a product's bits depend on nothing but its inputs
        assert fused_path == module_path
        return
    # the library's products (oneDNN, MKL) may not give one input the same bits from call to call (seen: 1e-6 nats)
    assert {r: [t for t, _, _ in v] for r, v in fused_path.items()} == {r: [t for t, _, _ in v] for r, v in module_path.items()}
    gap = max(abs(a[1] - b[1]) for r in module_path for a, b in zip(fused_path[r], module_path[r]))
    assert gap < 1e-4, gap
