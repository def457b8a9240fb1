"""A running picker: serve's app (its request path, load tracking, scraping, health probes,
metrics, admin and decision log, built by `controller.proxy.app.create_app`) with its HTTP
routes cut down to the operator's, and the gRPC server of the picker's services beside it.
`specroute picker` runs one; tests run one in their own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from controller.picker.picker import Health, Picker, build_server
from controller.proxy.app import CORE, create_app, make_runner
from controller.proxy.config import Settings
from controller.proxy.errors import NotFound
from controller.proxy.headers import PoolRewrite
from controller.proxy.lifecycle import ask_for_usage
from controller.proxy.ticket import Ticket
from policies.base import Policy
from policies.registry import PolicyRegistry
from policies.spec import PolicyContext

log = logging.getLogger("specroute.picker")

OPERATOR_PATHS = ("/metrics", "/health", "/ready", "/admin/")
"""What the picker's HTTP port answers (serve's handlers); any other path is a 404 there."""
REFRESH_S = 10.0
"""How often the backends' host names are resolved again (their pods' addresses change)."""


@web.middleware
async def operator_only(request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
    if not request.path.startswith(OPERATOR_PATHS):
        raise NotFound(f"{request.path}: the picker's HTTP port serves /metrics, /health, /ready and /admin")
    return await handler(request)


@dataclass
class RunningPicker:
    app: web.Application
    picker: Picker
    health: Health
    server: grpc.aio.Server
    port: int
    """The ext_proc gRPC port."""
    metrics_url: str
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def stop(self, drain_s: float) -> None:
        """Stop taking streams; those open finish for up to `drain_s`, then are cut."""
        await self.health.servicer.enter_graceful_shutdown()
        await self.server.stop(drain_s)
        self.picker.close_all()


def _for_pool(rewrite: PoolRewrite) -> Callable[[Ticket, bytes, Any], bytes]:
    """serve's rewrite of a request for its pool (the pool's `model` name). The pool's API key
    is not the picker's to add: with the request headers not sent to it (deploy/gateway), the
    gateway sets them (Envoy: the route's `request_headers_to_add`)."""

    def for_pool(ticket: Ticket, raw: bytes, body: Any) -> bytes:
        return rewrite.apply(ticket.backend.pool, raw, body, CIMultiDict())[0]

    return for_pool


@contextlib.asynccontextmanager
async def running_picker(
    settings: Settings,
    policy: Policy,
    *,
    registry: PolicyRegistry,
    context: PolicyContext | None = None,
    metrics_port: int = 0,
    clock: Callable[[], float] = time.monotonic,
    metrics_registry: CollectorRegistry | None = None,
    health_checks: bool = True,
    scrape: bool = True,
    observers: Sequence[Any] = (),
) -> AsyncIterator[RunningPicker]:
    """The picker on `settings.host`, ext_proc on `settings.port` (0: any free port), HTTP on
    `metrics_port`; stopped (its streams cut) when the context ends. `observers` get each
    request's record as serve's do (`create_app`)."""
    app = create_app(
        settings, policy, registry=registry, context=context, clock=clock, metrics_registry=metrics_registry,
        health_checks=health_checks, scrape=scrape, observers=observers,
    )  # fmt: skip
    app.middlewares.append(operator_only)
    runner = make_runner(app, shutdown_timeout=0.5)
    await runner.setup()
    host = settings.host if ":" not in settings.host else f"[{settings.host}]"
    running: RunningPicker | None = None
    try:
        await web.TCPSite(runner, settings.host, metrics_port).start()
        core = app[CORE]
        tracker = core.tracker
        picker = Picker(
            settings, core.tickets, core.reports, tracker, clock=clock, ask_for_usage=ask_for_usage,
            for_pool=_for_pool(core.rewrite),
        )  # fmt: skip
        health = Health(tracker, clock)
        await picker.addresses.refresh()
        await health.update()
        server = build_server(picker, health, settings.body_limit_bytes + (1 << 20))
        port = server.add_insecure_port(f"{host}:{settings.port}")
        if port == 0:
            raise OSError(f"cannot listen on {settings.host}:{settings.port} (taken, or not an address here)")
        await server.start()
        running = RunningPicker(app, picker, health, server, port, f"http://{host}:{runner.addresses[0][1]}")
        running.tasks.append(asyncio.create_task(_keep_fresh(picker, health)))
        yield running
    finally:
        if running is not None:
            for task in running.tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await running.server.stop(0)
            running.picker.close_all()
        await runner.cleanup()


async def _keep_fresh(picker: Picker, health: Health) -> None:
    """gRPC health follows the backends' (every second); host names are resolved again every
    `REFRESH_S`."""
    loop = asyncio.get_running_loop()
    resolved = loop.time()
    while True:
        await asyncio.sleep(1.0)
        try:
            await health.update()
            if loop.time() - resolved >= REFRESH_S:
                resolved = loop.time()
                await picker.addresses.refresh()
        except Exception:  # one failed round must not end the refreshing
            log.exception("refreshing the picker's health and addresses failed")
