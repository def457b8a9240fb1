"""`specroute native`: compile the simulator's hot path with mypyc, or say whether it is built
(`simulator.native` says how a build is made, found and loaded)."""

from __future__ import annotations

import argparse

from controller.cli.args import CommandError
from simulator import native


def configure_native(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Compile the simulator's hot path (the values, the view builder, the routing core, "
        "cost_model and the event engine) with mypyc, for `specroute simulate` runs about 2.5x as "
        "fast with the same output to the bit. Needs mypy and a C compiler "
        "(pip install 'specroute[native]'); a build matches the sources it was made from, and is "
        "ignored once they change."
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    b = sub.add_parser("build", help="Compile (or find) the build for the sources on disk.")
    b.add_argument("--force", action="store_true", help="Compile again even when a build exists.")
    b.set_defaults(func=_build)
    s = sub.add_parser("status", help="Whether a build exists for the sources on disk, and where.")
    s.set_defaults(func=_status)


def _build(args: argparse.Namespace) -> int:
    try:
        native.build(force=args.force)
    except native.NativeError as e:
        raise CommandError(str(e)) from e
    except OSError as e:
        raise CommandError(f"cannot write the build under {native.builds_dir()}: {e}") from e
    return 0


def _status(args: argparse.Namespace) -> int:
    status = native.status()
    print(f"native simulator: {status.reason}")
    if status.directory is not None:
        print(f"build: {status.directory}")
    print(f"builds directory: {native.builds_dir()} (SPECROUTE_NATIVE_DIR)")
    return 0 if status.directory is not None else 1
