"""`specroute emulate`: run one emulated SGLang server (plain or EAGLE-3) from a speed profile.

Prints one line when it listens, `emulator (MODE) listening on http://HOST:PORT` (the real
port with `--port 0`), so tools can spawn it as a subprocess; SIGINT/SIGTERM stop it cleanly.
The flags are the fields of `simulator.emulator.config.EmulatorConfig` and `FaultConfig`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from controller.cli.args import CommandError, add_model_flags, model_values, port, run_async
from policies.profile import ProfileError, resolve_profile
from simulator.emulator.accept_rules import AcceptRules, AcceptRulesError, load_accept_rules
from simulator.emulator.app import run_emulator
from simulator.emulator.config import EmulatorConfig, FaultConfig

DEFAULT_PROFILE = "kimi-k25-int4-8gpu"
_FAULT = "fault_"


def _hint_factor(text: str) -> tuple[str, float]:
    tag, sep, value = text.partition("=")
    try:
        factor = float(value)
    except ValueError:
        factor = float("nan")
    if not sep or not tag or not factor > 0:
        raise argparse.ArgumentTypeError(f"expected TAG=FACTOR with FACTOR > 0, got {text!r}")
    return tag, factor


def configure_emulate(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Run an emulated SGLang server (OpenAI-compatible API, native /generate, /server_info, "
        "/model_info, /v1/loads, /metrics, /abort_request) whose timing follows a speed profile "
        "by continuous batching. Token text is synthetic; token counts are exact."
    )
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"Profile file or built-in profile name (default: {DEFAULT_PROFILE}).",
    )
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: 127.0.0.1).")
    p.add_argument("--port", type=port, default=30000, help="Port (default: 30000; 0 picks a free one).")
    p.add_argument(
        "--hint-factor",
        type=_hint_factor,
        action="append",
        default=[],
        metavar="TAG=FACTOR",
        help="Acceptance factor for requests with x-specroute-hint: TAG (repeatable), e.g. code=1.2.",
    )
    p.add_argument(
        "--accept-rules",
        metavar="FILE",
        help='Acceptance by prompt content (eagle): a JSON list of {"match": REGEX, "factor": F} searched in '
        "order in the canonical prompt text (first match wins, default 1), and optionally "
        '{"temperature_slope": S} (factor x (1 - S x temperature), floored at 0.3).',
    )
    fields = add_model_flags(p, EmulatorConfig, skip=("profile", "hint_factors", "accept_rules"))
    f = p.add_argument_group("fault knobs (for tests)")
    faults = add_model_flags(f, FaultConfig, dest_prefix=_FAULT)
    p.set_defaults(func=run, config_fields=fields, fault_fields=faults)


def build_config(args: argparse.Namespace) -> EmulatorConfig:
    """Raises ProfileError, AcceptRulesError or ValidationError with a readable message."""
    rules = load_accept_rules(args.accept_rules) if args.accept_rules else AcceptRules()
    return EmulatorConfig(
        profile=resolve_profile(args.profile),
        hint_factors=dict(args.hint_factor),
        accept_rules=rules,
        faults=FaultConfig(**model_values(args, args.fault_fields, _FAULT)),
        **model_values(args, args.config_fields),
    )


def _describe(e: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(x) for x in err['loc']) or 'config'}: {err['msg']}" for err in e.errors()
    )


async def serve(config: EmulatorConfig, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with run_emulator(config, host, port) as server:
        print(f"emulator ({config.mode}) listening on {server.url}", flush=True)
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except (ProfileError, AcceptRulesError) as e:
        raise CommandError(e) from None
    except ValidationError as e:
        raise CommandError(_describe(e)) from None
    try:
        run_async(serve(config, args.host, args.port))
    except OSError as e:
        raise CommandError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m controller.cli.emulate` (same flags as `specroute emulate`)."""
    from controller.cli import main as specroute

    return specroute(["emulate", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
