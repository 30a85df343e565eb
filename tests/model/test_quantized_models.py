"""Each quantization on the real model: loads as quantized layers, runs through the engine's paged path
exactly as transformers runs the same quantized model, and stays fluent and close to the original."""

import functools

import pytest
import torch
from bitsandbytes import functional as bnb_functional

from app.bench.fidelity import heldout_text, perplexity
from app.config import ModelConfig
from app.cpu.gptq import Int4Linear, gptq_weights
from app.cpu.int4_kernels import OursInt4Kernel, TorchInt4Kernel, available_int4_kernels
from app.cpu.linear_kernels import bf16_products_available
from app.engine import Request
from app.models import ModelLoadError, load_model
from app.models.quantization import quantized_linear_bytes
from tests.model.conftest import (assert_tracks_transformers, engine_greedy_with_logprobs, greedy, keeping_transformers_copy, make_engine,
                                  run_engine, transformers_model)

pytestmark = pytest.mark.model

BASE = "smollm2-135m-instruct"
GPTQ = "smollm2-135m-instruct-gptq"
LAYER_CLASSES = {"bnb-int8": "Linear8bitLt", "bnb-nf4": "Linear4bit", "gptq": "TorchAtenLinear"}
# How far the engine's log-probabilities may sit from transformers' on the same quantized model (a bug in
# positions, KV or masking moves them by whole nats), by the precision each library computes in:
# - nf4 on a CPU without avx512_bf16 dequantizes and runs an fp32 matmul: only summation order differs
#   (fp32's 24-bit mantissa: differences ~1e-5 nats; tolerance 0.01).
# - bf16 activations: nf4 on a CPU with avx512_bf16 (bitsandbytes' fused CPU kernel) and GPTQ's CPU int4
#   kernels (GPTQModel's, and ours where the CPU has avx512_bf16) cast activations to bf16 whatever the model
#   dtype (8-bit mantissa: relative rounding up to 2^-9 before each of the ~210 products a token passes), and
#   GPTQModel's tiles a packed batch differently from one sequence. Measured on an AVX-512 EPYC: nf4 up to
#   0.055 nats, GPTQ up to 0.066; tolerance 0.3.
# - LLM.int8 computes in fp16 and picks its outlier columns from the whole batch (any row above 6.0): a
#   token's logits depend on its batch-mates (measured up to 0.37 on an AVX-512 EPYC; tolerance 0.75).
NF4_IN_BF16 = bnb_functional.has_avx512bf16()
LOGPROB_TOLERANCE = {"bnb-int8": 0.75, "bnb-nf4": 0.3 if NF4_IN_BF16 else 0.01, "gptq": 0.3}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nName three fruits.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
]


def _load(method: str, dtype: str = "float32"):
    return load_model(ModelConfig(source=GPTQ if method == "gptq" else BASE, quantization=method, dtype=dtype))


@functools.cache
def _loaded(method: str):
    """Each quantized model in fp32, loaded once for the module's tests (a copy as loaded kept for references)."""
    return keeping_transformers_copy(_load(method))


@pytest.fixture(scope="module", params=["bnb-int8", "bnb-nf4", "gptq"])
def quantized(request):
    return request.param, _loaded(request.param)


GREEDY_TOKENS = 16


@functools.cache
def _greedy_run(method: str) -> tuple[list[Request], dict]:
    """The engine's greedy answers to PROMPTS on each quantized model, with their log-probabilities (one run,
    read by the tests below)."""
    return engine_greedy_with_logprobs(_loaded(method), PROMPTS, max_tokens=GREEDY_TOKENS)


def test_loads_as_quantized_layers(quantized):
    method, loaded = quantized
    classes = {type(m).__name__ for m in loaded.model.model.layers[0].modules()}
    assert LAYER_CLASSES[method] in classes
    stored, bf16 = quantized_linear_bytes(loaded.model)
    assert 0 < stored < 0.6 * bf16  # int8 ~50%, 4-bit ~25% of the same layers in bf16


def test_paged_engine_runs_the_quantized_model_as_transformers_does(quantized):
    """Teacher-forced through the plain transformers forward of the same quantized model, every token the
    engine chose is that model's top choice (up to a near-tie) with the same log-probability."""
    method, loaded = quantized
    requests, logprobs = _greedy_run(method)
    assert_tracks_transformers(loaded, requests, logprobs, LOGPROB_TOLERANCE[method])


def test_quantized_output_is_fluent(quantized, loaded_fp32):
    """The unquantized model finds the quantized model's greedy continuations likely (low perplexity)."""
    method, loaded = quantized
    requests, _ = _greedy_run(method)
    for request in requests:
        prompt, output = request.prompt_token_ids, list(request.output_token_ids)
        with torch.inference_mode():
            logits = transformers_model(loaded_fp32)(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
        ppl = float(torch.nn.functional.cross_entropy(logits, torch.tensor(output)).exp())
        text = loaded.tokenizer.decode(output)
        assert ppl < 8, (method, text, ppl)


def test_gptq_is_small_and_close_to_full_precision(loaded_fp32):
    """GPTQ weights <= 40% of the bf16 bytes of the quantized layers; held-out perplexity within 15% of the
    full-precision model's."""
    gptq = _loaded("gptq")
    stored, bf16 = quantized_linear_bytes(gptq.model)
    assert stored <= 0.40 * bf16, (stored, bf16)
    text = heldout_text()[:2000]  # ~440 tokens, one perplexity window (measured: GPTQ 1.09x the fp32 model's)
    with torch.inference_mode():
        assert perplexity(gptq, text) <= 1.15 * perplexity(loaded_fp32, text)


def test_the_gptq_model_passes_the_load_time_parity_check():
    """What a served GPTQ model proves at start (engine.parity_check), run here once for every test app that
    starts it with the check off, on the batch-invariant kernels the equality tests use."""
    from app.engine.parity import check_parity

    loaded = _loaded("gptq")
    report = check_parity(make_engine(loaded), loaded)
    assert report.max_gap < report.tolerance, report


def test_the_gptq_model_in_bf16_runs_its_int4_layers_and_passes_the_parity_check():
    """dtype: bfloat16: the int4 kernels answer in fp32, and the bf16 layers after them take bf16 back."""
    from app.engine.parity import check_parity

    loaded = load_model(ModelConfig(source="smollm2-135m-instruct-gptq", quantization="gptq", dtype="bfloat16"))
    engine = make_engine(loaded, batch_invariant=False)
    assert any(type(m).__name__ == "Int4Linear" for m in loaded.model.modules())
    report = check_parity(engine, loaded)
    assert report.max_gap < report.tolerance, report


def test_torch_int4_is_gptqmodels_layer_bit_for_bit_and_the_rebuilt_weight_passes_the_parity_check():
    """Where ``auto`` keeps torch's int4 op it computes what GPTQModel's CPU layer computes, bit for bit (same op,
    scales and offsets), without the layer's per-call gather; with every layer on the weight rebuilt at each call
    (what ``auto`` takes for prefill chunks where it wins) the model passes the load-time parity check."""
    from app.engine.parity import check_parity

    loaded = _load("gptq")
    modules = [m for m in loaded.model.modules() if type(m).__name__ == LAYER_CLASSES["gptq"]][:7]  # every shape
    assert len({(m.out_features, m.in_features) for m in modules}) == 4
    assert "torch-int4" in available_int4_kernels()  # GPTQModel's CPU layer (LAYER_CLASSES) runs on the same ops
    torch.manual_seed(0)
    for module in modules:
        ours = Int4Linear(gptq_weights(module), module.bias, TorchInt4Kernel())
        x = torch.randn(5, module.in_features)
        with torch.inference_mode():
            assert torch.equal(ours(x), module(x))
    engine = make_engine(loaded, batch_invariant=False, cpu_gptq_kernel="dequant-fp32")
    assert {m.kernel.name for m in loaded.model.modules() if isinstance(m, Int4Linear)} == {"dequant-fp32"}
    report = check_parity(engine, loaded)
    assert report.max_gap < report.tolerance, report


def test_an_int4_kernel_that_computes_wrongly_is_not_installed(monkeypatch, caplog):
    """The load-time parity check compares the model with itself, so the kernels are checked as they are installed:
    one that multiplies wrongly (a bug on some CPU class) leaves GPTQModel's layers in place, and says so."""
    import logging

    loaded = _load("gptq")
    right = TorchInt4Kernel.apply
    monkeypatch.setattr(TorchInt4Kernel, "apply", lambda self, x, packed, bias, n: right(self, x, packed, bias, n) * 3.0)
    with caplog.at_level(logging.ERROR, logger="app.cpu.gptq"):
        make_engine(loaded, batch_invariant=False, cpu_gptq_kernel="torch-int4")
    assert not any(isinstance(m, Int4Linear) for m in loaded.model.modules())
    assert sum(type(m).__name__ == LAYER_CLASSES["gptq"] for m in loaded.model.modules()) == 210
    assert "int4 kernel torch-int4" in caplog.text and "GPTQModel's layer kept" in caplog.text


@pytest.mark.skipif(not bf16_products_available(), reason="our int4 kernel needs the CPU kernels and avx512_bf16")
def test_the_engine_runs_every_gptq_layer_on_our_int4_kernel_closer_to_the_checkpoint_than_gptqmodels():
    """Where the CPU has avx512_bf16 the batch-invariant engine swaps each GPTQ layer for ours: same codes, zeros and
    fp16 scales, applied in fp32, where GPTQModel's CPU kernel rounds scales and zeros to bf16 first."""
    loaded = _load("gptq")
    originals = [m for m in loaded.model.modules() if type(m).__name__ == LAYER_CLASSES["gptq"]]
    sampled = [(m, gptq_weights(m)) for m in originals[:4]]
    make_engine(loaded)
    assert sum(isinstance(m, Int4Linear) for m in loaded.model.modules()) == len(originals) == 210
    torch.manual_seed(0)
    for module, weights in sampled:
        x = torch.randn(8, module.in_features)
        exact = x.bfloat16().double() @ weights.dequantized().double().T
        ours = Int4Linear(weights, None, OursInt4Kernel())(x).double()
        with torch.inference_mode():
            theirs = module(x).double()
        assert (ours - exact).abs().max() < 1e-4 * exact.abs().max()  # fp32 sums of exact products
        assert (ours - exact).abs().max() < 0.25 * (theirs - exact).abs().max()


def test_a_gptq_checkpoint_loaded_again_gives_identical_greedy_output():
    """The cached built-in is what `python -m app quantize` writes (same code path, same settings), built by
    another process: a second load of it from disk (new modules, new packed weights) serves the same tokens."""
    first = _loaded("gptq")
    again = _load("gptq")
    assert again.model is not first.model
    requests = [Request(str(i), again.tokenizer.encode(p), greedy(GREEDY_TOKENS), again.eos_token_ids) for i, p in enumerate(PROMPTS)]
    tokens = run_engine(make_engine(again), requests)
    assert [tokens[r.request_id] for r in requests] == [list(r.output_token_ids) for r in _greedy_run("gptq")[0]]


def test_gptq_setting_on_a_full_precision_checkpoint_fails_with_advice():
    with pytest.raises(ModelLoadError, match="needs a GPTQ checkpoint.*python -m app quantize"):
        load_model(ModelConfig(source=BASE, quantization="gptq"))
    with pytest.raises(ModelLoadError, match="GPTQ-quantized; set model.quantization: gptq"):
        load_model(ModelConfig(source=GPTQ))
