"""One of our small CPU kernels against torch's ops, paired inside one engine:
``python -m app.bench kernel-pairs --kernel {norm,rotary}``.

Each saves a few ms of a 30-40 ms step, less than this shared machine's drift between two runs, so
one engine decodes with our kernel and with torch's ops alternately, ``--steps`` steps each,
``--pairs`` times (in alternating order), and the report's figure is the median of the paired
differences: each pair ran within a second, on the same batch and context lengths.

- ``norm``: the fused RMSNorm (``app/cpu/norm.py``) against transformers' module forward.
- ``rotary``: the RoPE kernel (``app/cpu/rotary.py``) against transformers' ``apply_rotary_pos_emb``,
  inside the one-frame decoder layers.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from torch import nn

from app.bench.load import LoadSpec, make_prompts
from app.bench.profile_steps import engine_holding
from app.config import ModelConfig
from app.engine import LLMEngine, Request, SamplingParams
from app.cpu.decoder import DecoderLayerForward
from app.cpu.norm import fused_norm_forwards
from app.cpu.rotary import KernelRotary
from app.models import load_model

def run_kernel_pairs(spec: LoadSpec, kernel: str, batches: list[int], dtype: str, pairs: int, steps: int) -> dict:
    loaded = load_model(ModelConfig(dtype=dtype))
    prompts = [loaded.tokenizer.encode(p) for p in make_prompts(LoadSpec(**{**spec.__dict__, "num_requests": max(batches)}))]
    report: dict = {"kernel": kernel, "dtype": dtype, "pairs": pairs, "steps_per_block": steps, "batches": {}}
    for batch in batches:
        engine = engine_holding(loaded, prompts[:batch], _new_tokens(pairs, steps), max_num_seqs=batch)
        switch, replaced = _SWITCHES[kernel](engine.runner.model)
        report["batches"][batch] = row = {"replaced": replaced, **_pairs(engine, switch, prompts[:batch], pairs, steps)}
        print(f"{kernel}, batch {batch}: ours {row['ours_step_ms']} ms, torch {row['torch_step_ms']} ms a step (medians); "
              f"torch - ours, median of {pairs} pairs: {row['paired_saving_ms']} ms", flush=True)
    return report


def _norm_switch(model: nn.Module) -> tuple[Callable[[bool], None], int]:
    """Turns the fused norms on and off (their modules' own forward when off); and how many there are."""
    fused = fused_norm_forwards(model)

    def use(ours: bool) -> None:
        for module, forward in fused.items():
            if ours:
                module.forward = forward
            else:
                module.__dict__.pop("forward", None)  # back to the class's own forward

    return use, len(fused)


def _rotary_switch(model: nn.Module) -> tuple[Callable[[bool], None], int]:
    """Gives the one-frame decoder layers our RoPE or transformers' own; and how many layers use ours."""
    forwards = [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), DecoderLayerForward)]
    kernels = {forward: forward.rotary for forward in forwards if isinstance(forward.rotary, KernelRotary)}

    def use(ours: bool) -> None:
        for forward, kernel in kernels.items():
            forward.rotary = kernel if ours else kernel.original

    return use, len(kernels)


_SWITCHES = {"norm": _norm_switch, "rotary": _rotary_switch}


def _new_tokens(pairs: int, steps: int) -> int:
    return 2 * pairs * steps + 64


def _pairs(engine: LLMEngine, use: Callable[[bool], None], prompts: list[list[int]], pairs: int, steps: int) -> dict:
    total = _new_tokens(pairs, steps)
    params = SamplingParams(max_tokens=total, min_tokens=total, temperature=0, ignore_eos=True)
    engine.add_requests([Request(f"pairs-{i}", p, params) for i, p in enumerate(prompts)])
    for _ in range(8):
        engine.step()  # past the prefill
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for i in range(pairs):
            for ours in (True, False) if i % 2 else (False, True):
                use(ours)
                started = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[ours].append((time.perf_counter() - started) / steps * 1000)
    finally:
        use(True)
    for i in range(len(prompts)):
        engine.abort_request(f"pairs-{i}")
    savings = [t - o for t, o in zip(times[False], times[True])]
    return {
        "ours_step_ms": round(statistics.median(times[True]), 2),
        "torch_step_ms": round(statistics.median(times[False]), 2),
        "paired_saving_ms": round(statistics.median(savings), 2),
    }
