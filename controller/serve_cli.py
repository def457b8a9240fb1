"""`specroute serve`, `specroute policies` and `specroute check-config`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import types
import typing
from typing import Any

import yaml

from controller.config import ConfigError, Settings, load_settings, parse_key_values
from policies.profile import ProfileError
from policies.registry import PolicyError, default_registry

log = logging.getLogger("specroute")

# Settings that get a generated `--flag` (scalars; secrets only via environment or file).
_NO_FLAG = frozenset(
    {
        "policy_params",
        "shadow_policies",
        "admin_token",
        "baseline_api_key",
        "eagle_api_key",
        "baseline",
        "eagle",
    }
)


def _is_scalar(annotation: Any) -> bool:
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return all(a in (str, int, float, bool, type(None)) for a in args)


def _metavar(name: str, annotation: Any) -> str:
    if annotation is bool:
        return "true|false"
    if name.endswith("_s"):
        return "SECONDS"
    if name in ("profile", "decision_log"):
        return "FILE" if name == "decision_log" else "FILE|NAME"
    return name.rsplit("_", 1)[-1].upper()


def _add_settings_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML file of settings (keys = setting names).")
    p.add_argument("--baseline", action="append", metavar="URL[,URL..]", help="Plain SGLang backends.")
    p.add_argument("--eagle", action="append", metavar="URL[,URL..]", help="EAGLE-3 SGLang backends.")
    p.add_argument(
        "--policy-param", action="append", default=[], metavar="KEY=VALUE", help="Policy parameter."
    )
    for name, field in Settings.model_fields.items():
        if name in _NO_FLAG or not _is_scalar(field.annotation):
            continue
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            metavar=_metavar(name, field.annotation),
            help=f"{field.description} (env SPECROUTE_{name.upper()}; default {field.default!r})",
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
        out["policy_params"] = parse_key_values(args.policy_param)
    return out


def _fail(message: str) -> int:
    print(f"specroute: error: {message}", file=sys.stderr, flush=True)
    return 2


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="Run the routing proxy in front of the two pools.")
    _add_settings_flags(p)
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="Logging level (DEBUG, INFO, WARNING, ERROR; default INFO).",
    )
    p.set_defaults(func=run_serve)

    p = subparsers.add_parser("policies", help="List the routing policies and their parameters.")
    p.set_defaults(func=run_policies)

    p = subparsers.add_parser("check-config", help="Validate a config file and print the settings.")
    p.add_argument("file", help="YAML config file.")
    p.set_defaults(func=run_check_config)


def _build(args: argparse.Namespace) -> tuple[Settings, Any, Any, Any]:
    from controller.app import policy_context

    settings = load_settings(cli_settings(args), os.environ, args.config)
    settings.require_backends()
    registry = default_registry()
    context = policy_context(settings)
    policy = registry.create(settings.policy, settings.policy_params, context)
    _check_observability(settings, registry, context)
    return settings, registry, context, policy


def _check_observability(settings: Settings, registry: Any, context: Any) -> None:
    """Fail at start-up, with the setting's name, on a bad shadow policy or decision log path."""
    from controller.shadow import build_shadows

    build_shadows(settings.shadow_policies, registry, context)
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


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings, registry, context, policy = _build(args)
    except (ConfigError, PolicyError, ProfileError) as e:
        return _fail(str(e))
    raise_open_files_limit()
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        pass
    try:
        asyncio.run(_serve(args, settings, registry, context, policy))
    except OSError as e:
        return _fail(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}")
    return 0


async def _serve(
    args: argparse.Namespace, settings: Settings, registry: Any, context: Any, policy: Any
) -> None:
    from aiohttp import web

    from controller.app import ADMIN, create_app, make_runner

    app = create_app(settings, policy, registry=registry, context=context)
    runner = make_runner(app, shutdown_timeout=settings.drain_timeout_s)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
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
        log.info("policy %s, baseline %s, eagle %s", settings.policy, settings.baseline, settings.eagle)

        def reload() -> None:
            if args.config is None:
                log.warning("SIGHUP: no --config file to re-read; policy unchanged")
                return
            try:
                fresh = load_settings(cli_settings(args), os.environ, args.config)
                app[ADMIN].reload(fresh)
            except (ConfigError, PolicyError, ProfileError) as e:
                log.error("SIGHUP: reload failed, policy unchanged: %s", e)

        loop.add_signal_handler(signal.SIGHUP, reload)
        await stop.wait()
        log.warning(
            "shutting down: draining %d in-flight request(s) for up to %g s",
            app[ADMIN].fwd.tracker.total_in_flight,
            settings.drain_timeout_s,
        )
    finally:
        await runner.cleanup()
    log.warning("stopped")


def run_policies(args: argparse.Namespace) -> int:
    try:
        registry = default_registry()
    except PolicyError as e:
        return _fail(str(e))
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
    from controller.app import policy_context
    from controller.shadow import build_shadows

    try:
        settings = load_settings({}, os.environ, args.file)
        settings.require_backends()
        registry, context = default_registry(), policy_context(settings)
        registry.create(settings.policy, settings.policy_params, context)
        build_shadows(settings.shadow_policies, registry, context)
    except (ConfigError, PolicyError, ProfileError) as e:
        return _fail(str(e))
    print(f"# {args.file}: valid (environment SPECROUTE_* applied; secrets masked)")
    print(yaml.safe_dump(settings.masked(), sort_keys=False), end="")
    return 0
