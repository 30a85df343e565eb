"""dtype bfloat16 on a CPU without native bf16: bf16 Linear weights on fp32 activations, exact against transformers.

Runs on every CPU our kernels run on: the loader is told bf16 is not native (as on an AVX2-only CPU)."""

import pytest
import torch

from app.config import ModelConfig
from app.engine import Request, SamplingParams
from app.cpu.ops import available as kernels_available, unavailable_reason
from app.models import load_model
from tests.model.conftest import PROMPTS, hf_greedy_divergence, make_engine
from tests.model.test_bf16 import native_bf16

pytestmark = [pytest.mark.model, pytest.mark.cpu_only]



@pytest.fixture(scope="module")
def loaded_bf16():
    with native_bf16(False):  # as on an AVX2-only CPU
        return load_model(ModelConfig(dtype="bfloat16"))


def test_bf16_resolves_to_bf16_weights_on_fp32_activations_where_bf16_is_not_native(loaded_bf16):
    if kernels_available():
        assert (loaded_bf16.dtype, loaded_bf16.weight_dtype) == (torch.float32, torch.bfloat16)
    else:  # without our GEMM only torch's emulated bf16 is left: the model is plain bf16
        assert (loaded_bf16.dtype, loaded_bf16.weight_dtype) == (torch.bfloat16, None)


@pytest.mark.skipif(not kernels_available(), reason=f"the CPU kernels cannot run here: {unavailable_reason()}")
def test_engine_with_bf16_weights_gives_transformers_greedy_tokens_on_the_same_rounded_weights(loaded_bf16):
    engine = make_engine(loaded_bf16, max_num_seqs=8)  # batch-invariant (one kernel): exact equality
    packed = [m for m in loaded_bf16.model.modules() if getattr(m, "kernel", None) is not None]
    assert packed and all(m.packed_weight.dtype == torch.bfloat16 for m in packed if hasattr(m, "packed_weight"))

    reference = load_model(ModelConfig(dtype="float32"))
    with torch.no_grad():  # the reference holds exactly the weights the bf16 panels hold; the embedding stays fp32
        head = reference.model.lm_head
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        for module in reference.model.modules():
            if type(module) is torch.nn.Linear:
                module.weight.copy_(module.weight.bfloat16().float())

    tokenizer = loaded_bf16.tokenizer
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0, ignore_eos=True)
    requests = [Request(f"bf16-{i}", tokenizer.encode(p), params) for i, p in enumerate(PROMPTS[:4])]
    engine.add_requests(requests)  # all four in one batch
    while engine.has_unfinished_requests():
        engine.step()
    for request in requests:
        assert hf_greedy_divergence(reference, request.prompt_token_ids, list(request.output_token_ids), 16) is None
