"""What a quantization costs in quality and buys in memory, measured on the real engine.

Per method, in a fresh process (so resident memory is that method's alone): weight bytes, the bytes of
the quantized Linear layers against the same layers in bf16, resident memory after the engine is built
and warm (what a replica holds), perplexity on held-out text (not the calibration set), and greedy
continuations of a prompt set through the engine's paged path, compared with the unquantized model's.
"""

from __future__ import annotations

import ctypes
import gc
import math
import multiprocessing
import time
from dataclasses import asdict, dataclass, field
from importlib import resources

import psutil
import torch

from app.config import EngineConfig, ModelConfig

# Varied prompts for greedy agreement (prose, code, chat, lists, arithmetic).
AGREEMENT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nName three planets.<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "SELECT name FROM users WHERE",
    "Water boils at",
    "Q: What is 12 times 12?\nA:",
    "<|im_start|>user\nGive me a tip for sleeping well.<|im_end|>\n<|im_start|>assistant\n",
    "The history of the printing press",
    "import json\n\ndef load(path):",
    "A good breakfast includes",
    "Photosynthesis is the process",
    "Dear Sir or Madam,",
    "The most important rule of cooking rice is",
    "In 1969, astronauts",
]
PERPLEXITY_WINDOW = 512


@dataclass
class FidelityResult:
    method: str
    source: str
    weight_mb: float
    quantized_layers_mb: float  # the Linear layers the method replaced, as stored
    quantized_layers_bf16_mb: float  # the same layers in bf16
    rss_mb: float  # resident memory of the process once the engine is built and warm
    perplexity: float
    load_s: float
    greedy: list[list[int]] = field(repr=False)
    gpu_mb: float | None = None  # on CUDA: GPU memory allocated by torch (weights + KV pool + workspace)


def heldout_text() -> str:
    return resources.files("app.models").joinpath("data", "heldout.txt").read_text(encoding="utf-8")


def measure_in_subprocess(model: ModelConfig, max_tokens: int, kv_cache_memory_mb: int) -> FidelityResult:
    """``measure`` in a fresh spawned process: its memory is the method's alone."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(measure, (model, max_tokens, kv_cache_memory_mb))


def measure(model: ModelConfig, max_tokens: int, kv_cache_memory_mb: int) -> FidelityResult:
    from app.engine import LLMEngine
    from app.models import load_model
    from app.models.quantization import quantized_linear_bytes, weight_bytes

    started = time.monotonic()
    loaded = load_model(model)
    load_s = time.monotonic() - started
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory_mb=kv_cache_memory_mb))
    greedy = greedy_continuations(engine, loaded, max_tokens)
    quantized, dense = quantized_linear_bytes(loaded.model)
    return FidelityResult(
        method=model.quantization,
        source=model.source,
        weight_mb=round(weight_bytes(loaded.model) / 2**20, 1),
        quantized_layers_mb=round(quantized / 2**20, 1),
        quantized_layers_bf16_mb=round(dense / 2**20, 1),
        rss_mb=round(_settled_rss() / 2**20, 1),
        perplexity=round(perplexity(loaded, heldout_text()), 3),
        load_s=round(load_s, 1),
        greedy=greedy,
        gpu_mb=_gpu_allocated_mb(loaded.device),
    )


def _gpu_allocated_mb(device) -> float | None:
    import torch

    if getattr(device, "type", str(device)) != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)


def _settled_rss() -> int:
    """Resident bytes once loading's temporaries are gone (freed heap returned to the OS, as a
    long-running replica's would be)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: report RSS as it is
        pass
    return psutil.Process().memory_info().rss


def greedy_continuations(engine, loaded, max_tokens: int) -> list[list[int]]:
    """``max_tokens`` greedy tokens (EOS masked) per agreement prompt, all in one engine batch."""
    from app.engine import Request, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0)
    requests = [
        Request(f"agree-{i}", loaded.tokenizer.encode(prompt), params, loaded.eos_token_ids)
        for i, prompt in enumerate(AGREEMENT_PROMPTS)
    ]
    engine.add_requests(requests)
    while engine.has_unfinished_requests():
        engine.step()
    return [list(r.output_token_ids) for r in requests]


@torch.inference_mode()
def perplexity(loaded, text: str, window: int = PERPLEXITY_WINDOW) -> float:
    """exp(mean next-token NLL) over consecutive, non-overlapping windows of the text."""
    ids = loaded.tokenizer.encode(text)
    total_nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start : start + window + 1]], device=loaded.device)
        if chunk.shape[1] < 2:
            break
        logits = loaded.model(chunk[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
        total_nll += nll.item()
        count += chunk.shape[1] - 1
    return math.exp(total_nll / count)


def agreement(reference: list[list[int]], candidate: list[list[int]]) -> dict[str, float]:
    """How far greedy outputs follow the reference: tokens before the first divergence, and whole matches."""
    prefix = [_common_prefix(r, c) / len(r) for r, c in zip(reference, candidate)]
    return {
        "prefix_agreement": round(sum(prefix) / len(prefix), 3),
        "identical_sequences": sum(r == c for r, c in zip(reference, candidate)),
        "num_sequences": len(reference),
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def report_row(result: FidelityResult, reference: FidelityResult) -> dict:
    row = {k: v for k, v in asdict(result).items() if k != "greedy"}
    row["greedy_agreement"] = agreement(reference.greedy, result.greedy)
    row["perplexity_vs_reference"] = round(result.perplexity / reference.perplexity, 3)
    if result.quantized_layers_bf16_mb:
        row["quantized_layers_fraction_of_bf16"] = round(result.quantized_layers_mb / result.quantized_layers_bf16_mb, 3)
    return row
