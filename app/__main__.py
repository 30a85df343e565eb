"""Command line (also installed as ``llm-serve``).

``python -m app prepare [name ...]``
    make built-in models ready (convert the GGUF, GPTQ-quantize derived ones) and print their paths; build the CPU
    kernels into the cache (once, rather than in every process that first needs them).
``python -m app quantize SOURCE OUTPUT [--bits 4 --group-size 64 --asym --desc-act --calibration FILE]``
    write a GPTQ checkpoint of any HF causal LM (hub id, local directory or built-in name) with GPTQModel.
"""

from __future__ import annotations

import argparse
import logging
import sys

from app.models.gptq import BITS, GPTQSettings, check_group_size, GPTQSettingsError, load_calibration, quantize_gptq
from app.models.registry import BUILTIN_MODELS, prepare_builtin


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "prepare":
            for name in args.names:
                print(prepare_builtin(name))
            _prepare_kernels()
        elif args.command == "quantize":
            _quantize(args)
    except GPTQSettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _prepare_kernels() -> None:
    from app.cpu.ops import load_ops

    reason = load_ops()
    logging.getLogger("app.prepare").info("CPU kernels: %s", "built and cached" if reason is None else f"not used here ({reason})")


def _quantize(args: argparse.Namespace) -> None:
    settings = GPTQSettings(bits=args.bits, group_size=args.group_size, desc_act=args.desc_act, sym=not args.asym,
                            offload_to_disk=not args.no_offload)
    source = str(prepare_builtin(args.source)) if args.source in BUILTIN_MODELS else args.source
    check_group_size(source, settings.group_size, trust_remote_code=args.trust_remote_code)  # before anything slow
    calibration = load_calibration(args.calibration, limit=args.num_texts)
    print(quantize_gptq(source, args.output, settings, calibration, trust_remote_code=args.trust_remote_code))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser("prepare", help="make built-in models ready in the cache and print their paths")
    prepare.add_argument("names", nargs="*", default=["smollm2-135m-instruct"], choices=sorted(BUILTIN_MODELS), metavar="name")
    quantize = commands.add_parser("quantize", help="write a GPTQ checkpoint of a causal LM with GPTQModel")
    quantize.add_argument("source", help="hub id, local HF checkpoint directory or built-in model name")
    quantize.add_argument("output", help="directory to write the GPTQ checkpoint into")
    quantize.add_argument("--bits", type=int, default=4, choices=BITS)
    quantize.add_argument("--group-size", type=int, default=64, help="must divide every layer's input size; -1: per column")
    quantize.add_argument("--desc-act", action="store_true", help="act-order quantization (a little more accurate, slower)")
    quantize.add_argument("--asym", action="store_true", help="asymmetric groups (a zero point per group)")
    quantize.add_argument("--calibration", help="a .jsonl of {\"text\": ...} lines or a text file of blank-line-separated passages "
                          "(default: the project's 48 calibration texts)")
    quantize.add_argument("--num-texts", type=int, default=None, help="use only the first N calibration texts")
    quantize.add_argument("--no-offload", action="store_true", help="keep finished layers in memory, not on disk "
                          "(GPTQModel's offload loses an output layer not named lm_head: GPT-NeoX, Pythia)")
    quantize.add_argument("--trust-remote-code", action="store_true")
    return parser


if __name__ == "__main__":
    sys.exit(main())
