"""`specroute serve`, `specroute policies` and `specroute check-config`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import yaml
from pydantic.fields import FieldInfo

from controller.cli.args import CommandError, add_model_flags, run_async
from controller.cli.sighup import EarlyReload
from controller.proxy.config import ConfigError, Settings, load_settings
from controller.proxy.redact import Redactor, install, secrets_in_env, secrets_in_values
from policies.base import Policy
from policies.params import parse_assignments
from policies.profile import ProfileError
from policies.registry import PolicyRegistry, default_registry
from policies.spec import PolicyContext, PolicyError

if TYPE_CHECKING:
    from aiohttp import web

    from controller.cli.reload import ConfigReloader

log = logging.getLogger("specroute")

# Settings without a generated flag: secrets (environment or file only), the backend lists and
# the structured ones (their own flags below, or the config file).
_NO_FLAG = (
    "policy_params",
    "shadow_policies",
    "admin_token",
    "baseline_api_key",
    "eagle_api_key",
    "baseline",
    "eagle",
)
_METAVARS = {"profile": "FILE|NAME", "decision_log": "FILE"}


ACCEPT_BACKLOG = 2048
"""Listen backlog of the proxy's socket (see `_serve`)."""


def _help_suffix(name: str, field: FieldInfo) -> str:
    return f" (env SPECROUTE_{name.upper()}; default {field.default!r})"


def _add_settings_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML file of settings (keys = setting names).")
    p.add_argument("--baseline", action="append", metavar="URL[,URL..]", help="Plain SGLang backends.")
    p.add_argument("--eagle", action="append", metavar="URL[,URL..]", help="EAGLE-3 SGLang backends.")
    p.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='Policy parameter; VALUE is JSON when it parses (4, true, {"code": 1.2}), else text.',
    )
    # Values reach Settings as text: it validates them and names the flag in its errors.
    add_model_flags(
        p,
        Settings,
        skip=_NO_FLAG,
        typed=False,
        help_suffix=_help_suffix,
        metavars={name: "SECONDS" for name in Settings.model_fields if name.endswith("_s")} | _METAVARS,
    )


def cli_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flags the user actually gave, as raw setting values."""
    out: dict[str, Any] = {}
    for name in Settings.model_fields:
        value = getattr(args, name, None)
        if value is not None and name not in ("baseline", "eagle"):
            out[name] = value
    for pool in ("baseline", "eagle"):
        urls = getattr(args, pool, None)
        if urls:
            out[pool] = ",".join(urls)
    if args.policy_param:
        out["policy_params"] = parse_assignments(args.policy_param)
    return out


def configure_serve(p: argparse.ArgumentParser) -> None:
    _add_settings_flags(p)
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="Logging level (DEBUG, INFO, WARNING, ERROR; default INFO).",
    )
    p.set_defaults(func=run_serve)


def configure_policies(p: argparse.ArgumentParser) -> None:
    p.set_defaults(func=run_policies)


def configure_check_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="YAML config file.")
    p.set_defaults(func=run_check_config)


def _build(args: argparse.Namespace) -> tuple[Settings, PolicyRegistry, PolicyContext, Policy]:
    from controller.proxy.core import policy_context

    settings = load_settings(cli_settings(args), os.environ, args.config)
    settings.require_backends()
    registry = default_registry()
    context = policy_context(settings)
    policy = registry.create(settings.policy, settings.policy_params, context)
    return settings, registry, context, policy


def check_observability(settings: Settings, registry: PolicyRegistry, context: PolicyContext) -> None:
    """Fail at start-up, with the setting's name, on a bad shadow policy or decision log path."""
    from controller.proxy.shadow import build_shadows

    build_shadows(settings.shadow_policies, registry, context)
    if settings.state_file:
        from controller.proxy.learned_state import check_state_path

        check_state_path(settings.state_file)
    if settings.decision_log:
        path = settings.decision_log
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise ConfigError(f"decision_log {path}: cannot open for writing: {e.strerror or e}") from None


def raise_open_files_limit() -> None:
    """Raise the soft open-files limit to the hard one: each proxied stream holds two sockets."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, e)


def start_up(args: argparse.Namespace) -> tuple[Settings, PolicyRegistry, PolicyContext, Policy, Redactor]:
    """What `serve` and `picker` do before they listen: logging at `--log-level`, every log line
    through the secrets filter, the settings and the policy built (a `CommandError` names what
    is wrong), the open-files limit raised."""
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Every log line passes this filter: no secret reaches stderr, whoever logs it.
    redactor = Redactor(secrets_in_env(os.environ))
    install(redactor)
    try:
        settings, registry, context, policy = _build(args)
    except (ConfigError, PolicyError, ProfileError) as e:
        raise CommandError(e) from None
    redactor.add(secrets_in_values(dict(settings)))
    raise_open_files_limit()
    return settings, registry, context, policy, redactor


def run_serve(
    args: argparse.Namespace,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    routes: Sequence[web.RouteDef] = (),
) -> int:
    """`specroute serve`. `clock` is the app's (every deadline reads it) and `sleep` a sleep on it
    (the reload's settle intervals, the shutdown's grace); `routes` are added to the app. The
    command runs on the loop's clock with no route added; a test gives its own
    (`tests/driven_serve.py`)."""
    early_reload = EarlyReload.install()  # `main` installed it already when it ran `serve`
    settings, registry, context, policy, redactor = start_up(args)
    # Bind first: a serve that cannot listen (a port in use) exits having written nothing -- no
    # decision-log folder, no state file -- and the checks below create those only after it.
    try:
        sockets = listen(settings.host, settings.port)
    except OSError as e:
        raise CommandError(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}") from None
    try:
        check_observability(settings, registry, context)
    except (ConfigError, PolicyError, ProfileError) as e:
        for sock in sockets:
            sock.close()
        raise CommandError(e) from None
    try:
        served = _serve(
            args, settings, registry, context, policy, early_reload, redactor, clock, sleep, routes, sockets
        )
        run_async(served)
    except OSError as e:
        raise CommandError(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}") from None
    return 0


def listen(host: str, port: int) -> list[socket.socket]:
    """Bound sockets for every address of `host` (as asyncio's `create_server` binds them:
    SO_REUSEADDR, IPv6 sockets IPv6-only); the listen backlog is set when they are served."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def _serve(
    args: argparse.Namespace,
    settings: Settings,
    registry: PolicyRegistry,
    context: PolicyContext,
    policy: Policy,
    early_reload: EarlyReload,
    redactor: Redactor,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]],
    routes: Sequence[web.RouteDef],
    sockets: list[socket.socket],
) -> None:
    from aiohttp import web

    from controller.proxy.app import ADMIN, METRICS, TRACKER, create_app, drain, make_runner
    from controller.proxy.learned_state import keeper_for

    app = create_app(settings, policy, registry=registry, context=context, clock=clock)
    app.router.add_routes(routes)
    keeper = None
    if settings.state_file:
        keeper = keeper_for(settings, app[ADMIN], app[TRACKER], app[METRICS].registry)
        keeper.load()  # before the listener opens: the first request meets what was learned
    # `drain` below does the waiting; aiohttp's own shutdown then has only idle connections left.
    runner = make_runner(app, shutdown_timeout=0.5)
    await runner.setup()
    try:
        # aiohttp's default accept backlog (128) overflows when hundreds of clients connect at
        # once on a busy host, and the kernel then resets connections: keep a deeper queue (the
        # kernel caps it at net.core.somaxconn).
        for sock in sockets:
            await web.SockSite(runner, sock, backlog=ACCEPT_BACKLOG).start()
        port = runner.addresses[0][1]
        host = settings.host if ":" not in settings.host else f"[{settings.host}]"
        # Start-up objects (modules, settings, app) never die: keep them out of every collection,
        # and collect the young generation less often -- a request allocates a few hundred objects.
        gc.freeze()
        gc.set_threshold(20_000, 50, 100)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # Only now say so: a supervisor may send SIGTERM as soon as it reads this line.
        print(f"specroute listening on http://{host}:{port}", flush=True)
        log.info(
            "policy %s, baseline %s, eagle %s",
            settings.policy,
            [b.name for b in settings.baseline],
            [b.name for b in settings.eagle],
        )
        unnamed = sum(b.name == b.url for b in settings.backends())
        if not settings.backend_header and unnamed:
            log.warning(
                "backend_header is false, but %d backend(s) have no name: clients learn nothing of them, "
                "while /metrics labels and logs (operators' surfaces) name them by URL; configure them "
                "as NAME=URL to keep the URLs out of those too",
                unnamed,
            )

        reloader = reload_on_signals(args, settings, app, redactor, early_reload, sleep)
        if keeper is not None:
            keeper.start()
        await stop.wait()
        reloader.cancel()
        await _grace_period(app, stop, settings.shutdown_grace_s, sleep)
        log.warning(
            "shutting down: listener closed; draining %d in-flight request(s) for up to %g s",
            app[ADMIN].fwd.tracker.total_in_flight,
            settings.drain_timeout_s,
        )
        await drain(runner, settings.drain_timeout_s)
        if keeper is not None:
            await keeper.stop()  # after the drain: every outcome is learned from
    finally:
        await runner.cleanup()
    log.warning("stopped")


def reload_on_signals(
    args: argparse.Namespace,
    settings: Settings,
    app: Any,
    redactor: Redactor,
    early_reload: EarlyReload,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> ConfigReloader:
    """Serve's and the picker's signal handlers on the running loop, and the reloader behind
    SIGHUP: it re-reads `--config` merged with the same flags and environment, applies it to
    `app`'s admin, and reopens the decision log first (a log rotator sends SIGHUP after moving
    it); SIGUSR1 only reopens the log. A SIGHUP that came during start-up (`early_reload`) is
    acted on now."""
    from controller.cli.reload import ConfigReloader, ReloadMetrics
    from controller.proxy.app import ADMIN, METRICS, reopen_decision_log

    reloader = ConfigReloader(
        args.config,
        lambda text: load_settings(cli_settings(args), os.environ, args.config, config_text=text),
        app[ADMIN].reload,
        ReloadMetrics(app[METRICS].registry),
        settle_s=settings.reload_settle_s,
        redactor=redactor,
        hooks=[lambda: reopen_decision_log(app)],
        sleep=sleep,
    )
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, reloader.request)
    loop.add_signal_handler(signal.SIGUSR1, lambda: _reopen_logs(app))
    if early_reload.pending:
        log.warning("SIGHUP during start-up: re-reading the config now")
        reloader.request()
    return reloader


def _reopen_logs(app: Any) -> None:
    """SIGUSR1: reopen the decision log (after a rotation), and nothing else."""
    from controller.proxy.app import reopen_decision_log

    log.info("SIGUSR1: reopening the decision log")
    reopen_decision_log(app)


async def _grace_period(
    app: Any, stop: asyncio.Event, grace_s: float, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
) -> None:
    """`/ready` answers 503 from now on while requests are still served for `grace_s` (see
    `controller.proxy.shutdown`); a second SIGTERM/SIGINT ends the wait early. The wait is
    `sleep(grace_s)` raced against the second signal: `asyncio.sleep`, or a sleep on the app's
    clock a test gave (`run_serve`), so the test moves the grace past (the listener is still
    open then) instead of waiting for it."""
    from controller.proxy.shutdown import SHUTDOWN

    app[SHUTDOWN].begin()
    if grace_s <= 0:
        return
    log.warning("shutting down: /ready answers 503; still serving for %g s (shutdown_grace_s)", grace_s)
    stop.clear()
    second = asyncio.ensure_future(stop.wait())
    timer = asyncio.ensure_future(sleep(grace_s))
    try:
        await asyncio.wait({second, timer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (second, timer):
            task.cancel()
    if second.done() and not second.cancelled():
        log.warning("second signal: grace period cut short")


def run_policies(args: argparse.Namespace) -> int:
    try:
        registry = default_registry()
    except PolicyError as e:
        raise CommandError(e) from None
    for spec in registry.specs():
        print(f"{spec.name}{'  (needs --profile)' if spec.needs_profile else ''}")
        if spec.help:
            print(f"    {spec.help}")
        for key, typ, default, help_ in spec.describe_params():
            print(f"    --policy-param {key}=<{typ}>  default {default}  {help_}")
        print()
    for name, problem in sorted(registry.broken().items()):
        print(f"{name}  (installed plugin that failed to load: not usable)")
        print(f"    {problem}")
        print()
    return 0


def run_check_config(args: argparse.Namespace) -> int:
    from controller.proxy.core import policy_context
    from controller.proxy.shadow import build_shadows

    try:
        settings = load_settings({}, os.environ, args.file)
        settings.require_backends()
        registry, context = default_registry(), policy_context(settings)
        registry.create(settings.policy, settings.policy_params, context)
        build_shadows(settings.shadow_policies, registry, context)
    except (ConfigError, PolicyError, ProfileError) as e:
        raise CommandError(e) from None
    print(f"# {args.file}: valid (environment SPECROUTE_* applied; secrets masked)")
    print(yaml.safe_dump(settings.masked(), sort_keys=False), end="")
    return 0
