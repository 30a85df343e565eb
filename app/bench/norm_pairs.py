"""The fused RMSNorm against torch's, paired inside one engine: ``python -m app.bench norm-pairs``.

The saving (a few ms of a 30-40 ms step) is smaller than this shared machine's drift between two
runs, so one engine decodes with the fused norms and with torch's alternately, ``--steps`` steps
each, ``--pairs`` times (in alternating order), and the report's figure is the median of the paired
differences: each pair ran within a second, on the same batch and context lengths.
"""

from __future__ import annotations

import statistics
import time

from app.bench.load import LoadSpec, make_prompts
from app.config import EngineConfig, ModelConfig
from app.engine import LLMEngine, Request, SamplingParams
from app.engine.cpu_norm import fused_norm_forwards
from app.models import load_model


def run_norm_pairs(spec: LoadSpec, batches: list[int], dtype: str, pairs: int, steps: int) -> dict:
    loaded = load_model(ModelConfig(dtype=dtype))
    prompts = [loaded.tokenizer.encode(p) for p in make_prompts(LoadSpec(**{**spec.__dict__, "num_requests": max(batches)}))]
    report: dict = {"dtype": dtype, "pairs": pairs, "steps_per_block": steps, "batches": {}}
    for batch in batches:
        engine = LLMEngine(loaded, EngineConfig(max_num_seqs=batch))
        report["batches"][batch] = row = _pairs(engine, prompts[:batch], pairs, steps)
        print(f"batch {batch}: fused {row['fused_step_ms']} ms, torch {row['torch_step_ms']} ms a step (medians); "
              f"torch - fused, median of {pairs} pairs: {row['paired_saving_ms']} ms", flush=True)
    return report


def _pairs(engine: LLMEngine, prompts: list[list[int]], pairs: int, steps: int) -> dict:
    fused = fused_norm_forwards(engine.runner.model)
    total = 2 * pairs * steps + 64
    params = SamplingParams(max_tokens=total, min_tokens=total, temperature=0, ignore_eos=True)
    engine.add_requests([Request(f"norm-{i}", p, params) for i, p in enumerate(prompts)])
    for _ in range(8):
        engine.step()  # past the prefill
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(pairs):
        for use_fused in (True, False) if i % 2 else (False, True):
            for module, forward in fused.items():
                if use_fused:
                    module.forward = forward
                else:
                    module.__dict__.pop("forward", None)  # back to the class's own forward
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[use_fused].append((time.perf_counter() - started) / steps * 1000)
    for module, forward in fused.items():
        module.forward = forward
    for i in range(len(prompts)):
        engine.abort_request(f"norm-{i}")
    savings = [t - f for t, f in zip(times[False], times[True])]
    return {
        "fused_norms": len(fused),
        "fused_step_ms": round(statistics.median(times[True]), 2),
        "torch_step_ms": round(statistics.median(times[False]), 2),
        "paired_saving_ms": round(statistics.median(savings), 2),
    }
