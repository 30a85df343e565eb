"""The engine alone (no server, no HTTP) on the standard workload, for each batching mode.

Separates what the engine can do from what the serving path costs: compare these figures with
``compare`` (the same work through Ray Serve and HTTP) and with ``hf`` (transformers' own batching).
"""

from __future__ import annotations

import random
import time

from app.bench.load import MIXED_LONG_PROMPT_WORDS, WORDS, LoadSpec, make_prompts
from app.bench.percentiles import quantile
from app.config import EngineConfig, ModelConfig
from app.engine import LLMEngine, Request, SamplingParams
from app.models import load_model


def run_engine_bench(spec: LoadSpec, modes: list[str], dtype: str = "bfloat16", kernels: dict | None = None,
                     source: str | None = None, quantization: str = "none", device: str = "auto") -> dict:
    """``kernels``: EngineConfig's ``cpu_*_kernel`` settings to use (default: the config's defaults); ``source`` and
    ``quantization``: another checkpoint than the embedded model (e.g. its GPTQ build, quantization gptq)."""
    model = ModelConfig(dtype=dtype, device=device, quantization=quantization, **({"source": source} if source else {}))
    loaded = load_model(model)
    prompts = [loaded.tokenizer.encode(p) for p in make_prompts(spec)]
    kernels = kernels or {}
    results: dict = {"spec": {**spec.__dict__, "dtype": dtype, "device": device, "source": model.source,
                              "quantization": quantization, **kernels},
                     "modes": {}}
    for mode in modes:
        engine = LLMEngine(loaded, EngineConfig(batching=mode, **kernels))
        _run(engine, prompts[:2], 8, "warmup-" + mode)
        w1 = _run(engine, prompts, spec.max_tokens, mode)
        w2 = [_run(engine, [p], spec.max_tokens, f"{mode}-single{i}") for i, p in enumerate(prompts[:3])]
        long_prompt = _run(engine, [_long_prompt(loaded.tokenizer, spec.seed + len(results["modes"]))], 1, f"{mode}-long")
        results["modes"][mode] = {
            "W1_output_tok_per_s": w1["output_tok_per_s"],
            "W1_wall_s": w1["wall_s"],
            "W1_mean_step_ms": w1["mean_step_ms"],
            # every prompt arrives at once with nothing decoding: how the scheduler spreads a burst's prefill
            "W1_ttft_p50_s": w1["ttft_p50_s"],
            "W1_ttft_max_s": w1["ttft_max_s"],
            "W1_cpu_s": w1["cpu_s"],  # compare with `compare`'s W1 cpu_s_by_part["engine core"]
            "single_stream_tok_per_s": round(sum(r["output_tok_per_s"] for r in w2) / len(w2), 1),
            # W5's long prompt alone: its prefill (chunks of the step's token budget) and first token
            "long_prompt_tokens": long_prompt["prompt_tokens"],
            "long_prompt_ttft_s": long_prompt["wall_s"],
        }
        print(mode, results["modes"][mode], flush=True)
    return results


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0, ignore_eos=True)
    requests = [Request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    steps_before, busy_before = engine.counters.num_steps, engine.counters.busy_s
    cpu_before = time.process_time()  # every thread of this process: the engine runs here
    started = time.monotonic()  # the clock of Request.first_token_s
    engine.add_requests(requests)
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.monotonic() - started
    first_tokens = sorted(r.first_token_s - started for r in requests)
    tokens = sum(r.num_output_tokens for r in requests)
    steps = engine.counters.num_steps - steps_before
    return {
        "prompt_tokens": sum(len(p) for p in prompts),
        "wall_s": round(wall, 2),
        "output_tok_per_s": round(tokens / wall, 1),
        "mean_step_ms": round(1000 * (engine.counters.busy_s - busy_before) / max(steps, 1), 1),
        "ttft_p50_s": round(quantile(first_tokens, 0.5), 3),
        "ttft_max_s": round(first_tokens[-1], 3),
        "cpu_s": round(time.process_time() - cpu_before, 1),
    }


def _long_prompt(tokenizer, seed: int) -> list[int]:
    """W5's long prompt (a fresh nonce first, so no prefix cache holds it)."""
    rng = random.Random(seed)
    text = f"Note {rng.getrandbits(64):016x}: " + " ".join(rng.choice(WORDS) for _ in range(MIXED_LONG_PROMPT_WORDS))
    return tokenizer.encode(text)
