"""The `specroute` command line.

How it works: `COMMANDS` names every command, the module that implements it and its one-line
help. `main` imports only the module of the command being run (so `specroute serve` loads no
simulator, plotting or progress-bar code) and asks it to configure its parser with
`configure_<command>(parser)`, which sets `func`: a callable taking the parsed namespace and
returning an exit code. A `CommandError` from anywhere in the command is printed as
`specroute COMMAND: error: MESSAGE` with exit code 2, like argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

# controller.cli.args (it imports pydantic) is imported in the functions: `main` must first
# install serve's early SIGHUP handler, which it can do within tens of milliseconds of exec.


@dataclass(frozen=True)
class Command:
    name: str
    module: str
    help: str


NATIVE_COMMANDS = frozenset({"simulate", "tune", "plan"})
"""Commands that load the compiled simulator when it is built for the sources on disk
(`simulator.native`), before they import it."""

COMMANDS: tuple[Command, ...] = (
    Command("serve", "controller.cli.serve", "Run the routing proxy in front of the two pools."),
    Command("picker", "controller.cli.picker", "serve's routing as a gateway's endpoint picker (ext_proc)."),
    Command("policies", "controller.cli.serve", "List the routing policies and their parameters."),
    Command("check-config", "controller.cli.serve", "Validate a config file and print the settings."),
    Command("emulate", "controller.cli.emulate", "An emulated SGLang server whose speed follows a profile."),
    Command("demo", "controller.cli.demo", "Emulated plain and EAGLE-3 servers plus specroute, compared."),
    Command("bench", "controller.cli.bench", "Measure a server: a concurrency sweep with 95% CIs."),
    Command("compare", "controller.cli.bench", "Bench results side by side with confidence intervals."),
    Command("profile", "controller.cli.bench", "Speed profile tools (merge)."),
    Command("simulate", "controller.cli.simulate", "Run a workload through simulated servers and policies."),
    Command("tune", "controller.cli.simulate", "Grid-search a policy's parameters on a simulated workload."),
    Command("plan", "controller.cli.plan", "Which mix of plain, EAGLE-3 and adaptive servers serves best."),
    Command("native", "controller.cli.native", "Compile the simulator's hot path (mypyc) for faster runs."),
)  # fmt: skip


def configure(command: Command, parser: argparse.ArgumentParser) -> None:
    module = importlib.import_module(command.module)
    getattr(module, "configure_" + command.name.replace("-", "_"))(parser)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `only`, just that command's options are configured (the others
    keep their name and help line for `specroute --help`)."""
    from controller.cli.args import Parser

    parser = Parser(
        prog="specroute",
        description="Adaptive speculation controller for twin SGLang pools (plain and EAGLE-3).",
    )
    from controller import specroute_version

    parser.add_argument("--version", action="version", version=f"specroute {specroute_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        # argparse %-formats help strings (not descriptions): a literal % must be doubled there.
        p = sub.add_parser(command.name, help=command.help.replace("%", "%%"), description=command.help)
        if only is None or command.name == only:
            configure(command, p)
    return parser


def _command_name(argv: Sequence[str]) -> str | None:
    """The command in `argv`: its first argument that is not an option."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = _command_name(argv)
    if name in ("serve", "picker"):
        from controller.cli.sighup import EarlyReload

        EarlyReload.install()
    elif name in NATIVE_COMMANDS:
        from simulator.native import activate

        loaded = activate()
        if loaded.directory is not None and not loaded.active:  # a build that does not load
            print(f"specroute {name}: note: {loaded.reason}; running the pure Python", file=sys.stderr)
    try:
        from controller.cli.args import USAGE_ERROR, CommandError

        known = {c.name for c in COMMANDS}
        parser = build_parser(name if name in known else "")
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, or a usage error argparse reported: its exit code
            return e.code if isinstance(e.code, int) else USAGE_ERROR
        func = getattr(args, "func", None)
        if func is None:
            parser.print_help()
            return USAGE_ERROR
        return int(func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C while a command module is still importing, or in a command
        return 130
    except CommandError as e:  # (bound: the import above is what can raise before it is)
        print(f"specroute {name}: error: {e}", file=sys.stderr, flush=True)
        return USAGE_ERROR
    except BrokenPipeError:
        # The reader went away (`specroute policies | head`): exit quietly, as Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
