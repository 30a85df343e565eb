"""Command line: ``python -m app prepare [name]`` converts a built-in model once and prints its path."""

from __future__ import annotations

import argparse
import logging
import sys

from app.models.registry import BUILTIN_MODELS, prepare_builtin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser("prepare", help="convert a built-in model into a cached HF checkpoint")
    prepare.add_argument("name", nargs="?", default="smollm2-135m-instruct", choices=sorted(BUILTIN_MODELS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "prepare":
        print(prepare_builtin(args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
