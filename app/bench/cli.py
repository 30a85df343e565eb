"""The command line of the benchmarks (``python -m app.bench``): every command's options, in one parser."""

from __future__ import annotations

import argparse

from app.bench.load import STANDARD_WORKLOADS, WORKLOADS
from app.config import CPU_ATTENTION_KERNELS, CPU_DECODER_LAYERS, CPU_GPTQ_KERNELS, CPU_LINEAR_KERNELS, CPU_NORM_KERNELS, CPU_ROTARY_KERNELS


def build_parser(description: str) -> argparse.ArgumentParser:
    """The command line of ``python -m app.bench`` (``description``: the commands' overview)."""
    parser = argparse.ArgumentParser(prog="python -m app.bench", description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["load", "peer", "sweep", "report", "compare", "engine", "hf", "quant", "profile", "gemm",
                                            "kernel-pairs", "spec", "soak", "grammar", "shape"])
    parser.add_argument("files", nargs="*", help="report: result JSON files (results/bench/*.json)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="load, peer, sweep: the server to drive")
    parser.add_argument("--name", default="peer", help="peer, sweep: the server's name in results and the report (vllm, naive, ...)")
    parser.add_argument("--launch", default=None, choices=["naive", "ours"],
                        help="peer, sweep: start this server for the run on --port and stop it after (naive: "
                             "benchmarks/naive_server.py; ours: the first model of --config through serve run)")
    parser.add_argument("--workloads", nargs="+", default=["W1", "W2"], choices=STANDARD_WORKLOADS, help="peer: the standard workloads to run")
    parser.add_argument("--extra-workloads", nargs="*", default=[], choices=[w for w in STANDARD_WORKLOADS if w not in ("W1", "W2")],
                        help="compare: W3/W4 too, for the single-stream modes")
    parser.add_argument("--workload", default="random", choices=WORKLOADS, help="load, sweep: the kind of requests")
    parser.add_argument("--rounds", type=int, default=2, help="sweep: requests per level = rounds x concurrency (at least 8); "
                        "spec: alternated rounds per workload and concurrency (pooled)")
    parser.add_argument("--slo-ttft-s", type=float, default=2.0, help="goodput: the most time to first token")
    parser.add_argument("--slo-itl-ms", type=float, default=200.0, help="goodput: the most for a request's p99 inter-token gap")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar per run (default: when stderr is a terminal)")
    parser.add_argument("--cpu-class", action="append", default=[], metavar="[FILE=]FLAGS",
                        help="report: the CPU class of result files that predate machine.cpu_class (FILE: a file name)")
    parser.add_argument("--no-plots", action="store_true", help="report: tables only")
    parser.add_argument("--config", default="configs/smollm2-cpu.yaml", help="compare, peer --launch ours: the app config to serve "
                        "(with --code, relative to that checkout)")
    parser.add_argument("--code", default=None, help="peer --launch ours: serve from this checkout of the project instead (e.g. "
                        "`git worktree add` of an earlier commit), measured by this one's load generator: an A/B of two versions")
    parser.add_argument("--model-source", default=None,
                        help="compare, peer --launch ours or naive: serve this checkpoint (a directory, e.g. from `shape`) as --model instead of the config's; "
                             "engine, profile: run it (with --quantization, e.g. smollm2-135m-instruct-gptq --quantization gptq)")
    parser.add_argument("--quantization", default="none", choices=["none", "bnb-int8", "bnb-nf4", "gptq"],
                        help="engine: the --model-source checkpoint's quantization")
    parser.add_argument("--shape", default="llama-371m", help="shape: the seeded random checkpoint to build (app/bench/shapes.py)")
    parser.add_argument("--seed", type=int, default=0, help="shape: the weights' seed")
    parser.add_argument("--modes", nargs="+", default=["none", "dynamic", "continuous"])
    parser.add_argument("--methods", nargs="+", default=None, help="quant: quantizations to measure (default: all four)")
    parser.add_argument("--gptq-source", default="smollm2-135m-instruct-gptq", help="quant: the GPTQ checkpoint of the model")
    parser.add_argument("--dtype", default="auto", help="quant, hf, engine, compare: model dtype (auto: as model.dtype auto picks here)")
    parser.add_argument("--device", default=None, help="quant: cpu or cuda (default: the config's model.device); "
                                                             "engine: auto (default) | cpu | cuda; hf: cpu (default) | cuda")
    parser.add_argument("--agreement-tokens", type=int, default=32, help="quant: greedy tokens per agreement prompt")
    parser.add_argument("--skip-serving", action="store_true", help="quant: fidelity only, no serve run")
    parser.add_argument("--skip-fidelity", action="store_true", help="quant: serving only (no perplexity or agreement runs)")
    parser.add_argument("--single-stream-modes", nargs="*", default=["continuous"], help="modes that also run W2")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="profile, gemm, grammar: sequences per decode step (gemm: rows)")
    parser.add_argument("--kernels", nargs="+", default=["avx2", "onednn", "torch"], help="gemm: the Linear kernels to compare (auto, avx2, avx2-bf16, onednn, torch; "
                             "the bf16 routes onednn-bf16, torch-bf16; the 4-bit ones int4-avx512-bf16, torch-int4, dequant-fp32, dequant-bf16; "
                             "one of ours with +2mb, e.g. avx512-bf16+2mb: its weights in 2 MB pages, as the engine keeps them)")
    parser.add_argument("--steps", type=int, default=20, help="profile: timed decode steps per batch size; kernel-pairs: steps per block")
    parser.add_argument("--pairs", type=int, default=12, help="kernel-pairs: ours/torch block pairs per batch size")
    parser.add_argument("--kernel", default="norm", choices=["norm", "rotary"], help="kernel-pairs: which of our kernels to pair with torch's ops")
    parser.add_argument("--linear-kernel", default="auto", choices=CPU_LINEAR_KERNELS, help="profile, engine: the fp32 Linear kernel")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="profile, engine: one fixed-order Linear kernel for every row count (engine.batch_invariant)")
    parser.add_argument("--attention-kernel", default="auto", choices=CPU_ATTENTION_KERNELS, help="profile, engine: paged attention on CPU (auto: per kind of step, timed)")
    parser.add_argument("--norm-kernel", default="auto", choices=CPU_NORM_KERNELS, help="profile, engine: RMSNorm on CPU")
    parser.add_argument("--rotary-kernel", default="auto", choices=CPU_ROTARY_KERNELS, help="profile, engine: RoPE on CPU")
    parser.add_argument("--temperature", type=float, default=0.0, help="spec: sample at this temperature (0: greedy); "
                        "answers then run to --max-tokens, so every run does the same work")
    parser.add_argument("--gptq-kernel", default="auto", choices=CPU_GPTQ_KERNELS,
                        help="spec, engine, quant (serving): GPTQ 4-bit layers: auto (per row bucket, as timed on this CPU) | torch (GPTQModel's) | a 4-bit kernel's name")
    parser.add_argument("--decoder-layer", default="auto", choices=CPU_DECODER_LAYERS,
                        help="profile, engine: one-frame decoder layer forward (auto) or the module's (torch)")
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--dynamic-window-s", type=float, default=0.25, help="compare: batch_wait_timeout_s for dynamic")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=56)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrencies", type=int, nargs="+", default=None,
                        help="spec: concurrent streams per run (default 1 8); sweep: the levels (default 1 2 4 8 16 32 64)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="spec: the longest draft")
    parser.add_argument("--duration-s", type=float, default=300, help="soak: how long to send requests")
    parser.add_argument("--rate", type=float, default=4.0, help="soak: requests per second (16-word prompts, 32 streamed tokens)")
    parser.add_argument("--server-factory", default=None, help="soak: what each replica serves, module:attribute "
                        "(e.g. tests.serve.fake_model:fake_model_server; default: the real model)")
    parser.add_argument("--out", default=None, help="the JSON file to write (report: the markdown file, default docs/benchmarks.md)")
    return parser
