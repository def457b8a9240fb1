"""`specroute picker`: serve's routing as a gateway's endpoint picker (Envoy ext_proc over gRPC).

It takes serve's flags, environment variables and config file. `--port` (on `--host`) is the
ext_proc gRPC port; `--metrics-port` serves `/metrics`, `/health`, `/ready` and the admin
routes over HTTP (serve's own handlers: the same app, without its inference routes). Start-up,
SIGHUP reloads and the shutdown grace follow serve's.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from controller.cli.args import CommandError, run_async
from controller.cli.serve import (
    _grace_period,
    check_observability,
    configure_serve,
    reload_on_signals,
    start_up,
)
from controller.cli.sighup import EarlyReload
from controller.proxy.config import ConfigError, Settings
from controller.proxy.redact import Redactor
from policies.base import Policy
from policies.profile import ProfileError
from policies.registry import PolicyRegistry
from policies.spec import PolicyContext, PolicyError

log = logging.getLogger("specroute")


def configure_picker(p: argparse.ArgumentParser) -> None:
    configure_serve(p)  # serve's flags and --log-level
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        metavar="N",
        help="HTTP port (on --host) of /metrics, /health, /ready and the admin routes (0: any free port; "
        "default 9090). --port is the ext_proc gRPC port.",
    )
    p.set_defaults(func=run_picker)


def run_picker(args: argparse.Namespace) -> int:
    try:
        import envoy.service.ext_proc.v3  # noqa: F401 - only to say clearly what is missing
        import grpc  # noqa: F401
    except ImportError as e:
        raise CommandError(
            f"specroute picker needs the 'picker' extra ({e.name} is missing): "
            "pip install 'specroute[picker]'"
        ) from None
    early_reload = EarlyReload.install()  # `main` installed it already when it ran `picker`
    settings, registry, context, policy, redactor = start_up(args)
    try:
        check_observability(settings, registry, context)
    except (ConfigError, PolicyError, ProfileError) as e:
        raise CommandError(e) from None
    try:
        run_async(_pick(args, settings, registry, context, policy, redactor, early_reload))
    except OSError as e:
        raise CommandError(f"cannot listen on {settings.host}: {e.strerror or e}") from None
    return 0


async def _pick(
    args: argparse.Namespace,
    settings: Settings,
    registry: PolicyRegistry,
    context: PolicyContext,
    policy: Policy,
    redactor: Redactor,
    early_reload: EarlyReload,
) -> None:
    from controller.picker.service import running_picker
    from controller.proxy.app import TRACKER

    async with running_picker(
        settings, policy, registry=registry, context=context, metrics_port=args.metrics_port
    ) as running:
        app = running.app
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        reloader = reload_on_signals(args, settings, app, redactor, early_reload)
        host = settings.host if ":" not in settings.host else f"[{settings.host}]"
        # Only now say so: a supervisor may send SIGTERM or SIGHUP as soon as it reads this line.
        print(
            f"specroute picker listening on {host}:{running.port} (ext_proc gRPC); "
            f"metrics on {running.metrics_url}",
            flush=True,
        )
        log.info(
            "policy %s, baseline %s, eagle %s",
            settings.policy, [b.name for b in settings.baseline], [b.name for b in settings.eagle],
        )  # fmt: skip
        await stop.wait()
        reloader.cancel()
        # /ready and gRPC readiness fail from here: the gateway stops opening streams; the open
        # ones go on through the grace and the drain.
        await running.health.servicer.enter_graceful_shutdown()
        await _grace_period(app, stop, settings.shutdown_grace_s)
        log.warning(
            "shutting down: %d request(s) in flight; waiting up to %g s for them",
            app[TRACKER].total_in_flight, settings.drain_timeout_s,
        )  # fmt: skip
        await running.stop(settings.drain_timeout_s)
    log.warning("stopped")
