"""`specroute serve` on a clock the test drives (`driven_clock.DrivenClock`), for the tests of the
real process whose deadlines are seconds to minutes long (reload settling, shutdown grace,
request timeouts).

    python tests/driven_serve.py [serve's flags...]

It runs what `specroute serve` runs -- the same flags, environment, config file, signal handling
and app (`controller.cli.serve.run_serve`) -- with two things given to it: the clock (and its
sleep), and the route `POST /_test/clock` that moves it. Only on a loopback address.
"""

from __future__ import annotations

import sys

from aiohttp import web
from driven_clock import DrivenClock

from controller.cli import build_parser
from controller.cli.args import USAGE_ERROR, CommandError
from controller.cli.serve import run_serve
from controller.cli.sighup import EarlyReload

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def main(argv: list[str]) -> int:
    EarlyReload.install()
    args = build_parser("serve").parse_args(["serve", *argv])
    if args.host is not None and args.host not in LOOPBACK:
        print(f"driven_serve: a test clock on {args.host}: loopback only", file=sys.stderr)
        return USAGE_ERROR
    clock = DrivenClock()
    try:
        return run_serve(args, clock=clock, sleep=clock.sleep, routes=[web.post(clock.PATH, clock.handle)])
    except CommandError as e:
        print(f"driven_serve: error: {e}", file=sys.stderr, flush=True)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
