"""The `specroute` command line. Each subcommand lives in its own module, which provides
`add_parser(subparsers)`; the parser it adds sets `func` to a callable taking the parsed
namespace and returning an exit code."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

COMMAND_MODULES: tuple[str, ...] = (
    "controller.serve_cli",
    "controller.bench_cli",
    "simulator.emulate_cli",
    "controller.demo",
    "simulator.cli",
    "simulator.plan_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specroute",
        description="Adaptive speculation controller for twin SGLang pools (plain and EAGLE-3).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()  # imports every command module: Ctrl-C may land here too
        args = parser.parse_args(argv)
        func = getattr(args, "func", None)
        if func is None:
            parser.print_help()
            return 2
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`specroute policies | head`): exit quietly, as Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
