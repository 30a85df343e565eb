"""Benchmarks: ``python -m app.bench {load,peer,sweep,report,compare,engine,hf,quant,spec,profile,gemm,kernel-pairs,soak,grammar,shape}``
(``make bench`` runs ``compare``, ``sweep``, ``quant --methods gptq``, ``hf``, ``peer`` for the configured peers and
``report``; ``make bench-quant`` runs ``quant``).

- ``load``: drive an already running server (e.g. ``make serve``) with N concurrent streaming requests
  (``--workload random|shared-prefix-chat|rewrite|mixed``).
- ``peer``: the standard workloads (``--workloads``, default W1 W2) against any OpenAI-compatible server
  (``--url``, ``--name``, ``--model``: its served name); ``--launch naive`` starts the naive transformers
  server (benchmarks/naive_server.py) for the run and stops it after.
- ``sweep``: one workload at each of ``--concurrencies`` against ``--url``: throughput, TTFT/TPOT/ITL
  percentiles and goodput per concurrency.
- ``report``: render result JSON files into markdown (``--out``, e.g. docs/benchmarks.md) and PNG plots
  (with matplotlib: the ``bench`` extra).
- ``compare``: start the app once per batching mode with ``serve run``, run the standard workloads
  (W1: 32 concurrent x 128 tokens; W2: 8 requests one at a time) and print a table, with the CPU
  seconds each part of the server (engine core, replica, ingress, proxy, Ray) spent on W1.
- ``engine``: the engine alone (no server) on the same workload, per mode: what serving costs
  (W1's CPU seconds too, to set against the served engine core's).
- ``hf``: transformers' own ``generate_batch`` and ``generate`` on the same workload, offline.
- ``profile``: decode steps of the engine at fixed batch sizes, timed and under torch's profiler.
- ``gemm``: the CPU Linear kernels (our AVX2 GEMM, oneDNN, torch; oneDNN's and torch's bf16 routes) on the model's matrix shapes.
- ``kernel-pairs``: decode steps with one of our small kernels (``--kernel norm``: RMSNorm; ``rotary``:
  RoPE) and with torch's ops, alternated inside one engine.
- ``spec``: speculative decoding (n-gram drafts; the embedded model drafting for its GPTQ build) against the
  same target alone, on chat and rewrite workloads at 1 and 8 streams: acceptance, speed-up, cost ratio, and
  the Leviathan et al. prediction (app/bench/spec_bench.py). JSON plus a markdown file.
- ``quant``: per quantization (none, bnb-int8, bnb-nf4, gptq) weight and resident memory, held-out
  perplexity and greedy agreement with bf16 (the fidelity report), then naive bf16 and batched
  bf16/int8/nf4/GPTQ served through HTTP on W1 (the comparison table). JSON plus a markdown file.
- ``grammar``: structured outputs' cost per step: the grammar masks of ``--batches`` constrained rows and their
  application to the logits, beside a decode step of the same batch (app/bench/grammar_cost.py).
- ``soak``: the whole config under ``serve run`` at a steady ``--rate`` of short streamed completions for
  ``--duration-s``: failed requests, the RSS of every part of the app every 10 s (start, end, MB/min),
  latency percentiles (app/bench/soak.py).
- ``shape``: build a larger model of a named shape (``--shape llama-371m``: seeded random weights, the embedded
  tokenizer) in the model cache, for ``peer --model-source`` and vLLM (app/bench/shapes.py).
Every command prints its numbers and saves them as JSON (``--out``), with the command line, the start time
and the machine (CPU class). Load results carry goodput under ``--slo-ttft-s`` / ``--slo-itl-ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import yaml

from app.bench.cli import build_parser
from app.bench.load import LoadSpec, run_load, run_sweep, run_workloads, warm_up, workload_spec
from app.bench.report_sources import portable

RESULTS = Path("results/bench")


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__).parse_args(argv)
    command = portable("python -m app.bench " + shlex.join(sys.argv[1:] if argv is None else argv))
    if args.command == "report":
        return report(args, command)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    progress = _progress(args)
    spec = LoadSpec(model=args.model, num_requests=args.requests, concurrency=args.concurrency,
                    prompt_words=args.prompt_words, max_tokens=args.max_tokens, workload=args.workload,
                    slo_ttft_s=args.slo_ttft_s, slo_itl_ms=args.slo_itl_ms)
    if args.command == "load":
        result = asyncio.run(run_load(LoadSpec(**{**spec.__dict__, "base_url": args.url}), progress=progress))
    elif args.command == "peer":
        result = peer(args, spec, progress)
    elif args.command == "sweep":
        result = sweep(args, spec, progress)
    elif args.command == "hf":
        from app.bench.hf_baseline import run_hf_baselines

        device = _resolved_device(args.device or "cpu")
        result = run_hf_baselines(spec, source=args.model_source or "smollm2-135m-instruct",
                                  dtype=_concrete_dtype(args.dtype, device), device=device)
    elif args.command == "engine":
        from app.bench.engine_bench import run_engine_bench

        device = _resolved_device(args.device or "auto")
        result = run_engine_bench(spec, args.modes, dtype=_engine_dtype(args.dtype, device), **_kernel_args(args),
                                  source=args.model_source, quantization=args.quantization, device=device)
    elif args.command == "quant":
        result = quant(args, spec)
    elif args.command == "profile":
        from app.bench.profile_steps import run_step_profile

        result = run_step_profile(spec, args.batches, _engine_dtype(args.dtype), args.steps, **_kernel_args(args),
                                  source=args.model_source)
    elif args.command == "kernel-pairs":
        from app.bench.kernel_pairs import run_kernel_pairs

        result = run_kernel_pairs(spec, args.kernel, args.batches, _engine_dtype(args.dtype), args.pairs, args.steps)
    elif args.command == "spec":
        from app.bench.spec_bench import run_spec_bench

        result = run_spec_bench(args.max_tokens, tuple(args.concurrencies or (1, 8)), args.num_speculative_tokens, args.dtype,
                                args.gptq_kernel, args.rounds, args.temperature)
    elif args.command == "gemm":
        from app.bench.gemm import run_gemm_bench

        result = run_gemm_bench(args.batches, args.kernels)
    elif args.command == "grammar":
        from app.bench.grammar_cost import run_grammar_cost

        result = run_grammar_cost(args.batches, _engine_dtype(args.dtype))
    elif args.command == "soak":
        result = soak(args)
    elif args.command == "shape":
        from app.bench.shapes import build_shape, parameter_count

        path = build_shape(args.shape, args.seed)
        print(path, flush=True)
        result = {"shape": args.shape, "seed": args.seed, "dir": str(path), "parameters": parameter_count(args.shape)}
    else:
        result = compare(args, spec, progress)
    result["command"] = command
    result["started_utc"] = started
    result["finished_utc"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    result["machine"] = _machine()
    name = f"{args.command}-{args.name}" if args.command == "peer" else args.command
    out = Path(args.out or RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if args.command in ("quant", "spec"):
        from app.bench.quant import markdown as quant_markdown
        from app.bench.spec_bench import markdown as spec_markdown

        table = (quant_markdown if args.command == "quant" else spec_markdown)(result)
        out.with_suffix(".md").write_text(table + "\n")
        print(table)
    elif args.command in ("compare", "peer"):
        print(format_table(result))
    elif args.command == "sweep":
        from app.bench.report_tables import sweep_table

        print(sweep_table(result))
    elif args.command == "soak":
        from app.bench.soak import format_table as soak_table

        print(soak_table(result))
    elif args.command not in ("profile", "gemm", "kernel-pairs", "spec", "grammar"):  # these printed their own tables as they went
        print(json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=2))  # per-request records: in the file
    print(f"saved {out}")
    return 0


def peer(args, spec: LoadSpec, progress: bool) -> dict:
    """The standard workloads against a server that is already running (or that ``--launch`` starts)."""
    with _launched(args) as url:
        runs = run_workloads(LoadSpec(**{**spec.__dict__, "base_url": url}), args.workloads, progress, label=args.name)
    return {"peer": args.name, "url": url, "model": args.model, "launch": args.launch, "servers": {args.name: runs}}


def sweep(args, spec: LoadSpec, progress: bool) -> dict:
    with _launched(args) as url:
        base = LoadSpec(**{**spec.__dict__, "base_url": url})
        warm_up(base)
        levels = run_sweep(base, args.concurrencies or [1, 2, 4, 8, 16, 32, 64], rounds=args.rounds, progress=progress)
    return {"sweep": args.name, "url": url, "model": args.model, "workload": args.workload, "levels": levels}


def _launched(args):
    """The server ``--launch`` names, started on ``--port`` for the run (a context giving its URL), else ``--url``."""
    import contextlib

    from app.bench.server import running_naive_server, running_server

    if args.launch is None:
        return contextlib.nullcontext(args.url)
    log = RESULTS / f"{args.command}-{args.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if args.launch == "naive":
        return running_naive_server(args.port, log, args.model, _concrete_dtype(args.dtype), checkpoint=args.model_source)
    code = Path(args.code).resolve() if args.code else None
    app_config = yaml.safe_load(((code or Path()) / args.config).read_text())
    app_config["models"] = app_config["models"][:1]  # the first model alone on the machine, as compare serves it
    if args.model_source:
        app_config["models"][0]["model"].update(source=args.model_source, name=args.model)
    return running_server(app_config, args.port, log, code=code)


def report(args, command: str) -> int:
    from app.bench.report import merge_sections, render_report

    if not args.files:
        raise SystemExit("report: name the result files, e.g. results/bench/compare-*.json")
    out = Path(args.out or "docs/benchmarks.md")
    markdown, written = render_report([Path(f) for f in args.files], out, cpu_classes=args.cpu_class,
                                      plots=not args.no_plots, command=command)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(merge_sections(out.read_text() if out.exists() else "", markdown))  # other classes' sections stay
    for path in [out, *written]:
        print(f"wrote {path}")
    return 0


def _progress(args) -> bool:
    """A progress bar on a terminal (or with --progress), none in logs (or with --no-progress)."""
    return sys.stderr.isatty() if args.progress is None else args.progress


def compare(args, spec: LoadSpec, progress: bool = False) -> dict:
    from app.bench.cpu_usage import cpu_seconds_by_part, process_cpu_snapshot
    from app.bench.server import running_server

    base = yaml.safe_load(Path(args.config).read_text())
    results: dict = {"config": args.config, "dtype": args.dtype, "modes": {}}
    for index, mode in enumerate(args.modes):
        app_config = copy.deepcopy(base)
        app_config["models"] = app_config["models"][:1]  # the first model alone on the machine
        if args.model_source:
            app_config["models"][0]["model"].update(source=args.model_source, name=args.model)
        if args.dtype != "auto":
            app_config["models"][0]["model"]["dtype"] = args.dtype
        engine = app_config["models"][0].setdefault("engine", {})
        engine["batching"] = mode
        if mode == "dynamic":  # static batches need a window long enough to gather a burst's stragglers
            engine["batch_wait_timeout_s"] = args.dynamic_window_s
        log = RESULTS / f"serve-{mode}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        # A port per mode: the previous server's Ray processes may still hold theirs for a moment after exit.
        with running_server(app_config, args.port + index, log) as url:
            results.setdefault("urls", {})[mode] = url  # the ingress replica's own port where direct ingress is on
            runs = {}
            served = LoadSpec(**{**spec.__dict__, "base_url": url})  # each workload is warmed up first
            names = ["W1"] + (["W2", *args.extra_workloads] if mode in args.single_stream_modes else [])
            for name in names:
                warm_up(workload_spec(name, served))  # outside the CPU seconds measured
                before = process_cpu_snapshot()
                runs[name] = run_workloads(served, [name], progress, label=mode, warm=False)[name]
                runs[name]["cpu_s_by_part"] = cpu_seconds_by_part(before, process_cpu_snapshot())
                print(f"{mode} {name} CPU seconds by part of the server: {runs[name]['cpu_s_by_part']}", flush=True)
        results["modes"][mode] = runs
        print(format_table(results), flush=True)
    return results


def soak(args) -> dict:
    from app.bench.soak import run_soak

    app_config = yaml.safe_load(Path(args.config).read_text())  # the whole app, as deployed
    report = run_soak(app_config, args.port, RESULTS / "serve-soak.log", args.duration_s, args.rate, args.model,
                      args.server_factory)
    return {"config": args.config, **report}


def quant(args, spec: LoadSpec) -> dict:
    from app.bench import quant as q
    from app.models.loader import cpu_has_native_bf16

    base = yaml.safe_load(Path(args.config).read_text())
    model = base["models"][0]["model"]
    device = args.device or model.get("device", "auto")
    # one concrete dtype for every row, so the rows compare like with like
    dtype = _concrete_dtype(args.dtype, device)
    report = {"config": args.config, "dtype": dtype, "device": device, "cpu_native_bf16": cpu_has_native_bf16()}
    if not args.skip_fidelity:
        report["fidelity"] = q.fidelity_report(args.methods or q.METHODS, model["source"], args.gptq_source, dtype, device,
                                               args.agreement_tokens, 512)
    if not args.skip_serving:
        rows = [row for row in q.ROWS if row[1] in (args.methods or q.METHODS)]
        if args.gptq_kernel != "auto":
            report["gptq_kernel"] = base["models"][0].setdefault("engine", {})["cpu_gptq_kernel"] = args.gptq_kernel
        report["serving"] = q.serving_report(rows, base, spec, args.port, args.gptq_source, dtype, device, RESULTS)
    return report


def _kernel_args(args: argparse.Namespace) -> dict:
    """The engine's CPU kernel settings the command line picked (EngineConfig field names)."""
    kernels = {"cpu_linear_kernel": args.linear_kernel, "cpu_attention_kernel": args.attention_kernel,
               "cpu_norm_kernel": args.norm_kernel, "cpu_rotary_kernel": args.rotary_kernel,
               "cpu_decoder_layer": args.decoder_layer, "batch_invariant": args.batch_invariant,
               "cpu_gptq_kernel": args.gptq_kernel}
    return {"kernels": kernels}


def _concrete_dtype(dtype: str, device: str = "cpu") -> str:
    """``auto`` as torch's dtype the server would load in on this machine (for the transformers-run peers)."""
    from app.models.loader import resolve_device, resolve_dtype

    return str(resolve_dtype(dtype, resolve_device(device))).removeprefix("torch.")


def _resolved_device(device: str) -> str:
    from app.models.loader import resolve_device

    return resolve_device(device).type


def _engine_dtype(dtype: str, device: str = "cpu") -> str:
    """``auto`` as our engine takes it here, so offline and served runs compare: bfloat16 where the loader puts
    ``auto`` on our bf16-product kernel (asking for bfloat16 takes the same path), else torch's dtype."""
    from app.models.loader import auto_takes_bf16_products, resolve_device

    if dtype == "auto" and auto_takes_bf16_products(resolve_device(device)):
        return "bfloat16"
    return _concrete_dtype(dtype, device)


def format_table(result: dict) -> str:
    """compare (``modes``) and peer (``servers``) results: one row per mode or server and workload."""
    rows = ["| mode | workload | output tok/s | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | E2E p50 (s) | goodput (req/s, share) |",
            "|---|---|---|---|---|---|---|---|"]
    for mode, runs in (result.get("modes") or result.get("servers") or {}).items():
        for name, r in runs.items():
            if not r.get("num_requests"):
                rows.append(f"| {mode} | {name} | failed: {r.get('first_error', '?')[:80]} | | | | | |")
                continue
            errors = f" ({r['num_errors']} errors)" if r.get("num_errors") else ""
            good = r.get("goodput")
            good = f"{good['req_per_s']}, {good['fraction']:.0%}" if good else ""
            rows.append(f"| {mode} | {name} | {r['output_tok_per_s']}{errors} | {r['ttft_s']['p50']} | {r['ttft_s']['p99']} | "
                        f"{r['tpot_ms']['p50']} | {r['e2e_s']['p50']} | {good} |")
    return "\n".join(rows)


def _machine() -> dict:
    import os

    import torch

    return {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "cpu_class": _cpu_class()}


def _cpu_class() -> list[str]:
    """The CPU features that pick our paths (as `lscpu | grep -o 'avx512_bf16\\|avx2'` shows them)."""
    from app.engine.host_cpus import cpu_flags

    return sorted((cpu_flags() or frozenset()) & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})


if __name__ == "__main__":
    sys.exit(main())
