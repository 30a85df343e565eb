"""``python -m app.bench quant``: the quantization comparison, fidelity and serving, in one report.

For each method (none, bnb-int8, bnb-nf4, gptq) the fidelity numbers of ``app.bench.fidelity``; then
each row of the comparison is served with ``serve run`` and driven through the OpenAI API with the
standard workload (W1: 32 concurrent streams x 128 tokens): naive (one request at a time) bf16, and
continuous batching in bf16, int8, nf4 and GPTQ. Written as JSON and as markdown tables.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

from app.bench.fidelity import measure_in_subprocess, report_row
from app.bench.load import LoadSpec, run_load
from app.config import ModelConfig

METHODS = ("none", "bnb-int8", "bnb-nf4", "gptq")
# (row label, quantization, batching mode); {dtype} is the compute dtype of the run
ROWS = (
    ("naive {dtype}", "none", "none"),
    ("batched {dtype}", "none", "continuous"),
    ("batched int8 (bnb)", "bnb-int8", "continuous"),
    ("batched nf4 (bnb, {dtype} compute)", "bnb-nf4", "continuous"),
    ("batched GPTQ 4-bit", "gptq", "continuous"),
)
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def model_for(method: str, base: str, gptq_source: str, dtype: str, device: str) -> ModelConfig:
    source = gptq_source if method == "gptq" else base
    return ModelConfig(source=source, quantization=method, dtype=dtype, device=device)


def fidelity_report(methods, base: str, gptq_source: str, dtype: str, device: str, max_tokens: int, kv_mb: int) -> dict:
    results = {}
    for method in methods:
        results[method] = measure_in_subprocess(model_for(method, base, gptq_source, dtype, device), max_tokens, kv_mb)
        print(f"fidelity {method}: {results[method]}", flush=True)
    reference = results.get("none") or next(iter(results.values()))
    return {method: report_row(result, reference) for method, result in results.items()}


def serving_report(rows, app_config: dict, spec: LoadSpec, port: int, gptq_source: str, dtype: str, device: str, log_dir: Path) -> dict:
    from app.bench.server import running_server

    results = {}
    for index, (label, method, batching) in enumerate(rows):
        label = label.format(dtype=SHORT_DTYPES.get(dtype, dtype))
        config = copy.deepcopy(app_config)
        served = config["models"][0]
        served["model"].update(
            {"source": gptq_source if method == "gptq" else served["model"]["source"], "quantization": method, "dtype": dtype, "device": device}
        )
        served.setdefault("engine", {})["batching"] = batching
        config["models"] = [served]  # each row alone on the machine
        log_dir.mkdir(parents=True, exist_ok=True)
        with running_server(config, port + index, log_dir / f"serve-quant-{index}.log") as url:
            warm = LoadSpec(**{**spec.__dict__, "base_url": url, "num_requests": 2, "concurrency": 2, "max_tokens": 8})
            asyncio.run(run_load(warm))
            results[label] = {"quantization": method, "batching": batching, **asyncio.run(run_load(LoadSpec(**{**spec.__dict__, "base_url": url})))}
        print(f"serving {label}: {results[label].get('output_tok_per_s')} tok/s", flush=True)
    return results


def markdown(report: dict) -> str:
    lines = ["### Fidelity", "",
             "| quantization | weights (MB) | quantized layers (MB, vs bf16) | process RSS (MB) | perplexity (vs unquantized) | greedy prefix agreement | identical greedy outputs |",
             "|---|---|---|---|---|---|---|"]
    for method, row in report.get("fidelity", {}).items():
        g = row["greedy_agreement"]
        gpu = f" (GPU {row['gpu_mb']})" if row.get("gpu_mb") else ""
        layers = f"{row['quantized_layers_mb']} ({row.get('quantized_layers_fraction_of_bf16', 1.0):.0%})" if row["quantized_layers_mb"] else "-"
        lines.append(f"| {method} | {row['weight_mb']} | {layers} | {row['rss_mb']}{gpu} | {row['perplexity']} (x{row['perplexity_vs_reference']}) | "
                     f"{g['prefix_agreement']:.0%} | {g['identical_sequences']}/{g['num_sequences']} |")
    if report.get("serving"):
        lines += ["", "### Serving (W1: 32 concurrent x 128 tokens, through HTTP)", "",
                  "| setup | weights (MB) | output tok/s | E2E p50 (s) | TTFT p50 (s) | TPOT p50 (ms) |", "|---|---|---|---|---|---|"]
        for label, r in report["serving"].items():
            weights = report.get("fidelity", {}).get(r["quantization"], {}).get("weight_mb", "?")
            if not r.get("num_requests"):
                lines.append(f"| {label} | {weights} | failed: {r.get('first_error', '?')[:60]} | | | |")
                continue
            lines.append(f"| {label} | {weights} | {r['output_tok_per_s']} | {r['e2e_s']['p50']:.1f} | {r['ttft_s']['p50']:.2f} | {r['tpot_ms']['p50']:.0f} |")
    return "\n".join(lines)
