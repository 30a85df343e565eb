"""What structured outputs cost per step: the masks of ``batch`` constrained rows (llguidance, in parallel)
and their application to the logits, timed at every token of a valid JSON answer, with a decode step of the
same batch for scale. ``python -m app.bench grammar --batches 1 32``."""

from __future__ import annotations

import json
import statistics
import time

import torch

from app.api.structured import request_grammar
from app.config import EngineConfig, ModelConfig
from app.engine import LLMEngine, Request, SamplingParams
from app.engine.grammar import Grammars, consume
from app.models import load_model

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "languages": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "languages": ["English", "French", "Analytical Engine code"]}


def run_grammar_cost(batches: list[int], dtype: str) -> dict:
    loaded = load_model(ModelConfig(dtype=dtype))
    vocab = loaded.model.config.vocab_size
    grammar = request_grammar({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}, None)
    answer = loaded.tokenizer.encode(json.dumps(ANSWER))
    report: dict = {"dtype": dtype, "vocab_size": vocab, "answer_tokens": len(answer), "threads": torch.get_num_threads(), "batches": {}}
    for batch in batches:
        grammars = Grammars(loaded.tokenizer, vocab, loaded.eos_token_ids)
        requests = [Request(str(i), [1], SamplingParams(grammar=grammar)) for i in range(batch)]
        for request in requests:
            request.matcher = grammars.matcher(grammar)
        logits = torch.randn(batch, vocab)
        mask_ms = []
        for token in answer:
            started = time.perf_counter()
            grammars.mask(logits, requests)
            mask_ms.append(1000 * (time.perf_counter() - started))
            for request in requests:
                consume(request, token)
        row = {"mask_ms_median": round(statistics.median(mask_ms), 3), "mask_ms_max": round(max(mask_ms), 3),
               "decode_step_ms": round(_decode_step_ms(loaded, batch), 1)}
        row["share_of_step"] = round(row["mask_ms_median"] / row["decode_step_ms"], 4)
        report["batches"][batch] = row
        print(f"batch {batch}: masks {row['mask_ms_median']} ms a step (max {row['mask_ms_max']}), "
              f"a decode step {row['decode_step_ms']} ms: {row['share_of_step']:.1%}", flush=True)
    return report


def _decode_step_ms(loaded, batch: int, steps: int = 5) -> float:
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=batch))
    params = SamplingParams(max_tokens=steps + 4, min_tokens=steps + 4, temperature=0, ignore_eos=True)
    engine.add_requests([Request(f"d{i}", [1, 2, 3, 4], params) for i in range(batch)])
    engine.step()  # the prefill
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return 1000 * (time.perf_counter() - started) / steps
