"""transformers' own batching on the benchmark workload, offline (no server): the reference to beat.

``generate_batch`` is transformers' continuous batching; ``generate`` with a static padded batch
and at batch 1 are given for scale. Same prompts as the load generator, same number of new tokens.
"""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from app.bench.load import LoadSpec, make_prompts
from app.models.loader import resolve_source


def run_hf_baselines(spec: LoadSpec, source: str = "smollm2-135m-instruct", dtype: str = "bfloat16",
                     device: str = "cpu") -> dict:
    path, _ = resolve_source(source)  # built-in names resolve to their converted checkpoint
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    prompts = [tokenizer.encode(p) for p in make_prompts(spec)]
    config = GenerationConfig(
        max_new_tokens=spec.max_tokens, min_new_tokens=spec.max_tokens, do_sample=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )
    results = {"spec": {**spec.__dict__, "source": source, "dtype": dtype, "device": device}}
    # generate_batch runs its loop on its own thread and manages grad mode itself: calling it under
    # inference_mode makes its cache tensors inference tensors, which that thread may not update.
    # Warmed up as every served figure is (first-call allocations and lazy set-up are not the batching's cost).
    warm = GenerationConfig(**{**config.to_dict(), "max_new_tokens": 4, "min_new_tokens": 4})
    model.generate_batch(inputs=prompts[:2], generation_config=warm, progress_bar=False)
    started = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    wall = time.perf_counter() - started
    errors = [o.error for o in outputs.values() if o.error]
    if errors:
        raise RuntimeError(f"generate_batch failed: {errors[0]}")
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    results["generate_batch"] = {"wall_s": round(wall, 2), "output_tokens": tokens, "output_tok_per_s": round(tokens / wall, 1)}
    with torch.inference_mode():
        _timed_generate(model, prompts[:1], warm)
        # two of W2's eight prompts: the same lengths, one at a time, so the rate per token is W2's
        results["generate_batch1"] = _timed_generate(model, prompts[:2], config)
    return results


def _timed_generate(model, prompts: list[list[int]], config: GenerationConfig) -> dict:
    """Plain ``generate``, one prompt at a time (the naive server's inner loop)."""
    started, tokens = time.perf_counter(), 0
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt], device=model.device), generation_config=config)
        tokens += out.shape[1] - len(prompt)
    wall = time.perf_counter() - started
    return {"wall_s": round(wall, 2), "output_tokens": tokens, "output_tok_per_s": round(tokens / wall, 1)}
