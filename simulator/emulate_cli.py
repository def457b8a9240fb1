"""`specroute emulate`: run one emulated SGLang server (plain or EAGLE-3) from a speed profile.

Prints one line when it listens, `emulator (MODE) listening on http://HOST:PORT` (the real
port with `--port 0`), so tools can spawn it as a subprocess; SIGINT/SIGTERM stop it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from policies.profile import ProfileError, resolve_profile
from simulator.emulator import EmulatorConfig, FaultConfig, run_emulator

DEFAULT_PROFILE = "kimi-k25-int4-8gpu"


def _hint_factor(text: str) -> tuple[str, float]:
    tag, sep, value = text.partition("=")
    try:
        factor = float(value)
    except ValueError:
        factor = float("nan")
    if not sep or not tag or not factor > 0:
        raise argparse.ArgumentTypeError(f"expected TAG=FACTOR with FACTOR > 0, got {text!r}")
    return tag, factor


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}")
    return port


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "emulate",
        help="run an emulated SGLang server whose speed follows a profile",
        description=(
            "Run an emulated SGLang server (OpenAI-compatible API, /server_info, /v1/loads, "
            "/metrics, /abort_request) whose timing follows a speed profile by continuous "
            "batching. Token text is synthetic; token counts are exact."
        ),
    )
    p.add_argument("--mode", required=True, choices=["baseline", "eagle"], help="plain or EAGLE-3 server")
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"profile file or built-in profile name (default: {DEFAULT_PROFILE})",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=30000, help="port (default: 30000; 0 picks a free one)")
    p.add_argument("--model", default="specroute-emulated", help="served model name")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per profile second: 0.5 runs twice as fast as the profile, 2.0 twice as "
        "slow (default: 1.0)",
    )
    p.add_argument("--max-running-requests", type=int, help="override the profile's cap")
    p.add_argument("--accept-length", type=float, help="override the profile's accept_length (eagle)")
    p.add_argument("--speculative-num-steps", type=int, default=3, help="draft steps per verify (eagle)")
    p.add_argument(
        "--hint-factor",
        type=_hint_factor,
        action="append",
        default=[],
        metavar="TAG=FACTOR",
        help="acceptance factor for requests with x-specroute-hint: TAG (repeatable), e.g. code=1.2",
    )
    p.add_argument(
        "--output-tokens-mean", type=float, default=256.0, help="mean output length w/o max_tokens"
    )
    p.add_argument("--output-tokens-cv", type=float, default=0.5, help="its coefficient of variation")
    p.add_argument("--stats-interval-steps", type=int, default=40, help="decode steps between gauge updates")
    p.add_argument("--api-key", help="require this Bearer key on generation routes")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    f = p.add_argument_group("fault knobs (for tests)")
    f.add_argument("--error-rate", type=float, default=0.0, help="fraction of generations answered 500")
    f.add_argument("--max-queued-requests", type=int, help="queue bound: 503 (streaming: 200 + error event)")
    f.add_argument("--stall-s", type=float, default=0.0, help="wall seconds before answering a generation")
    f.add_argument("--die-after-chunks", type=int, help="drop the connection after N content chunks")
    f.add_argument("--refuse-connections", action="store_true", help="close every connection unanswered")
    f.add_argument("--unhealthy", action="store_true", help="/health and /ready answer 503")
    p.set_defaults(func=run)
    return p


def build_config(args: argparse.Namespace) -> EmulatorConfig:
    """Raises ProfileError or ValidationError with a readable message."""
    faults = FaultConfig(
        error_rate=args.error_rate,
        max_queued_requests=args.max_queued_requests,
        stall_s=args.stall_s,
        die_after_chunks=args.die_after_chunks,
        refuse_connections=args.refuse_connections,
        unhealthy=args.unhealthy,
    )
    return EmulatorConfig(
        mode=args.mode,
        profile=resolve_profile(args.profile),
        model=args.model,
        time_scale=args.time_scale,
        max_running_requests=args.max_running_requests,
        accept_length=args.accept_length,
        speculative_num_steps=args.speculative_num_steps,
        hint_factors=dict(args.hint_factor),
        output_tokens_mean=args.output_tokens_mean,
        output_tokens_cv=args.output_tokens_cv,
        stats_interval_steps=args.stats_interval_steps,
        api_key=args.api_key,
        seed=args.seed,
        faults=faults,
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
    except ProfileError as e:
        print(f"specroute emulate: error: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:
        print(f"specroute emulate: error: {_describe(e)}", file=sys.stderr)
        return 2
    try:
        _run_loop(serve(config, args.host, args.port))
    except OSError as e:
        print(f"specroute emulate: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0


def _run_loop(main: Any) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        asyncio.run(main)
        return
    uvloop.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m simulator.emulate_cli` (same flags as `specroute emulate`)."""
    parser = argparse.ArgumentParser(prog="specroute")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["emulate", *(argv if argv is not None else sys.argv[1:])])
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
