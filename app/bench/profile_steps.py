"""Where an engine step's time goes: decode steps at fixed batch sizes, timed and under torch's profiler.

``python -m app.bench profile --batches 1 32`` loads the model (``--dtype``, auto as the server picks),
fills the engine with ``batch`` copies of the workload's prompts, steps past the prefill, then times
``--steps`` decode steps and profiles a few more. ``--linear-kernel`` (auto, avx2, onednn, torch),
``--attention-kernel``, ``--norm-kernel``, ``--rotary-kernel`` and ``--decoder-layer`` (auto, torch) pick the CPU
kernels and layer forward, for the comparisons in docs/engine.md.
Figures for the README's "what limits us" come from here.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch.profiler import ProfilerActivity, profile

from app.bench.load import LoadSpec, make_prompts
from app.config import EngineConfig, ModelConfig
from app.engine import LLMEngine, Request, SamplingParams
from app.models import LoadedModel, load_model

PROFILED_STEPS = 5  # steps under the profiler: parsing its trace costs ~0.5 s a step on two cores
_TOP_OPS = 12


def run_step_profile(spec: LoadSpec, batches: list[int], dtype: str, steps: int, kernels: dict | None = None,
                     profiled_steps: int = PROFILED_STEPS, source: str | None = None) -> dict:
    """``kernels``: EngineConfig's ``cpu_*_kernel`` settings to use (default: the config's defaults); ``source``: the
    checkpoint to profile (default: the embedded model)."""
    loaded = load_model(ModelConfig(dtype=dtype, **({"source": source} if source else {})))
    prompts = [loaded.tokenizer.encode(p) for p in make_prompts(LoadSpec(**{**spec.__dict__, "num_requests": max(batches)}))]
    kernels = kernels or {}
    report: dict = {"dtype": dtype, **kernels, "threads": torch.get_num_threads(), "batches": {}}
    # one start for every batch size
    engine = engine_holding(loaded, prompts, _new_tokens(steps, profiled_steps), max_num_seqs=max(batches), **kernels)
    for batch in batches:
        report["batches"][batch] = _profile_batch(engine, prompts[:batch], steps, profiled_steps)
        row = report["batches"][batch]
        print(f"batch {batch}: {row['step_ms']} ms a step, {row['tok_per_s']} tok/s", flush=True)
        for op in row["top_ops"]:
            print(f"  {op['share']:5.1%}  {op['ms_per_step']:7.2f} ms  {op['name']}")
    return report


def engine_holding(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int, **engine_fields) -> LLMEngine:
    """An engine whose KV pool holds every prompt and ``new_tokens`` after each, and no more: the default pool (1 GiB
    on a CPU, room for the model's whole context) costs ~2 s of CPU to zero at start, and its size changes no step's
    work. Its context is the longest of these sequences."""
    context = max(len(prompt) for prompt in prompts) + new_tokens
    loaded = dataclasses.replace(loaded, max_model_len=min(loaded.max_model_len, context))
    block = EngineConfig.block_size
    blocks = sum(-(-(len(prompt) + new_tokens) // block) for prompt in prompts)
    return LLMEngine(loaded, EngineConfig(num_kv_blocks=blocks, **engine_fields))


def _new_tokens(steps: int, profiled_steps: int) -> int:
    return steps + profiled_steps + 64  # enough tokens that every timed step is a decode of the whole batch


def _profile_batch(engine: LLMEngine, prompts: list[list[int]], steps: int, profiled_steps: int) -> dict:
    total = _new_tokens(steps, profiled_steps)
    params = SamplingParams(max_tokens=total, min_tokens=total, temperature=0, ignore_eos=True)
    engine.add_requests([Request(f"profile-{i}", p, params) for i, p in enumerate(prompts)])
    while engine.stats()["num_waiting"] or engine.counters.last_step_tokens != len(prompts):
        engine.step()  # prefill (in chunks) until a step is one decode token per sequence
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_s = (time.perf_counter() - started) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(profiled_steps):
            engine.step()
    for i in range(len(prompts)):
        engine.abort_request(f"profile-{i}")
    return {"step_ms": round(step_s * 1000, 1), "tok_per_s": round(len(prompts) / step_s, 1), "top_ops": _top_ops(prof, profiled_steps)}


def _top_ops(prof, profiled_steps: int) -> list[dict]:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [
        {"name": e.key, "share": round(e.self_cpu_time_total / total, 3),
         "ms_per_step": round(e.self_cpu_time_total / 1000 / profiled_steps, 2)}
        for e in events[:_TOP_OPS]
    ]
