"""One entry point installs the CPU fast path and says what runs where; with the kernels off, torch's ops run."""

import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from app.config import EngineConfig
from app.cpu import install_fast_path
from app.cpu.decoder import DecoderLayerForward
from app.cpu.linear import PackedLinear, PackedSiblingLinear
from app.cpu.ops import unavailable_reason
from app.engine.paged_attention import register_paged_attention
from tests.unit.cpu.conftest import needs_kernels


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    register_paged_attention(model)
    return model


def _install(model, caplog, **engine_fields):
    with caplog.at_level(logging.INFO, logger="app.cpu"):
        path = install_fast_path(model, EngineConfig(**engine_fields), torch.float32)
    lines = [r.getMessage() for r in caplog.records if r.name == "app.cpu"]
    assert lines == [path.describe()]  # one line at start
    return path, lines[0]


def _install_and_compare(caplog):
    """Install on a fresh model; its output must stay (to the float rounding of another summation order)."""
    model = _tiny_llama()
    ids = torch.randint(0, 64, (1, 9))
    with torch.inference_mode():
        expected = model(ids, use_cache=False).logits
        path, line = _install(model, caplog)
        got = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # our GEMM or oneDNN sum in another order than MKL
    return model, path, line


@needs_kernels
def test_installs_every_part_and_the_model_keeps_its_output(caplog):
    _, path, line = _install_and_compare(caplog)
    assert path.attention is not None
    for part in ("CPU kernels: on", "linear: avx2", "rms_norm: kernel (5 modules)", "one frame (2, rope kernel)",
                 "attention: kernel", "argmax: kernel", "bf16 native:"):
        assert part in line


def test_with_the_kernels_off_torch_runs_everything_and_the_log_says_why(kernels_off, caplog):
    model, path, line = _install_and_compare(caplog)
    assert "CPU kernels: off (turned off by LLM_SERVE_CPU_KERNELS=0)" in line
    assert path.attention is None and "attention: gather + SDPA" in line and "argmax: torch" in line
    assert "rms_norm: torch" in line and "rope torch" in line  # the one-frame forward is torch code over any packed GEMM
    # Linear layers run on oneDNN's prepacked GEMM or torch's own, whichever the bake-off timed faster per row count
    packed = [m for m in model.modules() if isinstance(m, (PackedLinear, PackedSiblingLinear))]
    kernels = [getattr(m, "kernel", None) or m.shared.kernel for m in packed]
    assert all(kernel.name in ("onednn", "torch") or {k.name for k in kernel.kernels} <= {"onednn", "torch"} for kernel in kernels)


@needs_kernels
def test_a_second_install_with_other_settings_takes_the_parts_back(caplog):
    model = _tiny_llama()
    _install(model, caplog)
    caplog.clear()
    path, line = _install(model, caplog, cpu_norm_kernel="torch", cpu_decoder_layer="torch", cpu_attention_kernel="torch")
    assert path.attention is None and "rms_norm: torch" in line and "decoder layers: module forward" in line
    assert not any(isinstance(layer.__dict__.get("forward"), DecoderLayerForward) for layer in model.modules())
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m).__name__.endswith("RMSNorm"))


def test_a_bf16_model_keeps_torchs_attention_and_an_fp32_model_reads_a_bf16_pool_with_the_kernel(caplog):
    assert install_fast_path(_tiny_llama(), EngineConfig(), torch.bfloat16).attention is None  # bf16 queries: torch
    path = install_fast_path(_tiny_llama(), EngineConfig(), torch.float32, torch.bfloat16)
    assert (path.attention is not None) == (unavailable_reason() is None)
    assert path.parts["KV cache"] == "bfloat16"


def test_batch_invariant_mode_off_the_cpu_warns_that_it_is_not_kept(caplog):
    """On a GPU the vendor's products choose their reduction by the batch's shape: the mode's promise does not hold
    there, and the start log says so (a model on the meta device stands in for one on a GPU)."""
    model = _tiny_llama().to("meta")
    for invariant in (False, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="app.cpu"):
            path = install_fast_path(model, EngineConfig(batch_invariant=invariant), torch.float32)
        assert path.parts == {"all": "torch (model on meta)"}
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert bool(warned) == invariant and all("batch_invariant" in line and "meta" in line for line in warned)
