"""The bf16 path on any CPU: a bf16 model through torch's ops, as ``dtype: auto`` serves it where bf16 is
native (AVX-512 bf16, AMX) and our kernels cannot run, and as ``dtype: bfloat16`` serves it on native-bf16
CPUs. On other CPUs torch emulates bf16 (slower, still correct), so every machine runs this path; the
fp32 tests cover the other resolution."""

from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from app.config import ModelConfig
from app.models import load_model
from app.models.loader import resolve_dtype
from tests.model.conftest import PROMPTS, assert_tracks_transformers, engine_greedy_with_logprobs, keeping_transformers_copy

pytestmark = pytest.mark.model

# bf16 keeps 8 significant bits: the logits themselves are bf16, and at SmolLM2's logit magnitudes (16-32)
# neighbouring bf16 values are 0.125 apart, so each side's log-probability may be off by half of that from
# the last rounding alone; the engine's packed steps (several sequences in one matmul, SDPA over the paged
# cache) also round at other places than transformers' one-sequence forward. Measured up to 0.16 nats on
# an AVX-512 EPYC; a bug in positions, KV or masks moves it by whole nats. Greedy choices may differ from
# transformers' only at such near-ties.
LOGPROB_TOLERANCE = 0.3


@contextmanager
def native_bf16(native: bool):
    """The loader's view of the CPU: does bf16 run natively here? (It picks the bf16 path from it.) Our bf16
    kernel is kept out of the view: test_bf16_products.py covers the path it gives a CPU with avx512_bf16."""
    with mock.patch("app.models.loader.cpu_has_native_bf16", return_value=native), \
            mock.patch("app.cpu.linear_kernels.bf16_products_available", return_value=False):
        yield


@pytest.fixture(scope="module")
def loaded_bf16():
    with native_bf16(True):  # as on an AVX-512 bf16 CPU, whatever this one is
        loaded = load_model(ModelConfig(dtype="bfloat16"))
    assert (loaded.dtype, loaded.weight_dtype) == (torch.bfloat16, None)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    return keeping_transformers_copy(loaded)


def test_auto_is_bf16_where_bf16_is_native_without_our_kernels_and_fp32_elsewhere(kernels_off):
    cpu = torch.device("cpu")
    with native_bf16(True):
        assert resolve_dtype("auto", cpu) == torch.bfloat16
    with native_bf16(False):
        assert resolve_dtype("auto", cpu) == torch.float32


def test_the_engine_in_bf16_tracks_transformers_on_the_same_bf16_model(loaded_bf16):
    """4 sequences in one batch, teacher-forced through transformers' own bf16 forward."""
    requests, logprobs = engine_greedy_with_logprobs(loaded_bf16, PROMPTS[:4], 16, max_model_len=512)
    assert all(r.num_output_tokens == 16 for r in requests)
    worst = assert_tracks_transformers(loaded_bf16, requests, logprobs, LOGPROB_TOLERANCE)
    print(f"bf16: largest |engine - transformers| log-probability {worst:.4f}")
