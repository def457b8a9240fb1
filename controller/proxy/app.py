"""The aiohttp application: routes, shared state and lifecycle.

`create_app` takes every collaborator (settings, policy, policy registry, optional client
session, clock, metrics registry) so tests build the real app around fakes. It builds the
request path's `controller.proxy.core.Core` and serves it over HTTP; one `cleanup_ctx` opens the
shared `ClientSession` (unless one was passed in) and runs the core's background work while the
app runs (`Core.running`: health checks, scrapes, the decision log; `reopen_decision_log` makes
the log open its path anew). The error middleware passes specroute's
error messages through `controller.proxy.identity` (`http_errors.CLIENT_TEXT`: backend names hidden
from clients with `backend_header: false`).

Shadow policies (`settings.shadow_policies`, or built ones passed as `shadows=`) are asked by
the `Forwarder` on every request. Further observers: pass `observers=[callable]`, or append to
`app[FORWARDER].observers`; each gets a `RequestRecord` once a request has ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from controller.proxy.admin import PolicyAdmin, admin_routes
from controller.proxy.config import Settings
from controller.proxy.core import Core, build_core, policy_context
from controller.proxy.errors import NoBackendAvailable, NotFound, ShuttingDown
from controller.proxy.forward import Forwarder
from controller.proxy.health import HealthChecker
from controller.proxy.http_errors import CLIENT_TEXT, error_middleware, expect_handler, http_log
from controller.proxy.info import list_models, model_info, server_info
from controller.proxy.load import LoadTracker
from controller.proxy.memory import keep_heap_small
from controller.proxy.metrics import Metrics, RelayCollector
from controller.proxy.scrape import ScrapeLoop
from controller.proxy.shutdown import SHUTDOWN, Shutdown, close_after_answer
from controller.proxy.ticket import Observer
from policies.base import POOLS, Policy
from policies.registry import PolicyRegistry
from policies.spec import PolicyContext

log = logging.getLogger("specroute")

SETTINGS = web.AppKey("settings", Settings)
FORWARDER = web.AppKey("forwarder", Forwarder)
TRACKER = web.AppKey("tracker", LoadTracker)
METRICS = web.AppKey("metrics", Metrics)
ADMIN = web.AppKey("admin", PolicyAdmin)
HEALTH = web.AppKey("health", HealthChecker)
SCRAPER = web.AppKey("scraper", ScrapeLoop)
CORE = web.AppKey("core", Core)


def create_app(
    settings: Settings,
    policy: Policy,
    *,
    registry: PolicyRegistry,
    session: aiohttp.ClientSession | None = None,
    clock: Callable[[], float] = time.monotonic,
    metrics_registry: CollectorRegistry | None = None,
    context: PolicyContext | None = None,
    observers: Sequence[Observer] = (),
    health_checks: bool = True,
    scrape: bool = True,
    shadows: Sequence[tuple[str, Policy]] | None = None,
) -> web.Application:
    """`shadows`: (label, policy) pairs; None builds `settings.shadow_policies` (PolicyError)."""
    keep_heap_small()  # what a request held goes back to the OS when it ends (the memory budget)
    app = web.Application(client_max_size=settings.body_limit_bytes, middlewares=[error_middleware])
    ctx = context if context is not None else policy_context(settings)
    core = build_core(
        settings, policy, registry=registry, metrics_registry=metrics_registry, clock=clock, context=ctx,
        observers=observers, shadows=shadows,
    )  # fmt: skip
    fwd = Forwarder(core)
    core.metrics.registry.register(RelayCollector(fwd.relays))
    app[SETTINGS], app[CORE], app[FORWARDER] = settings, core, fwd
    app[TRACKER], app[METRICS] = core.tracker, core.metrics
    if not core.identity.show:
        app[CLIENT_TEXT] = core.identity.for_clients
    app[ADMIN] = admin = PolicyAdmin(fwd, registry, ctx, adapt=core.ladders.adapt)
    core.rebuild = admin.fresh
    if core.ladders.pool_ladder() is not None:  # backend_adaptive: the policy predicts the ladder's speed
        admin.fresh()
        log.info("eagle pool: %s", core.ladders.describe())
    app[SHUTDOWN] = Shutdown(clock)
    app.on_response_prepare.append(close_after_answer)
    app.cleanup_ctx.append(Serving(session, health_checks=health_checks, scrape=scrape))
    admin_table = [(r.method, r.path, r.handler) for r in admin_routes(admin)]
    for method, path, handler in (*ROUTES, *admin_table):
        # A bogus `Expect` is answered before any middleware runs: our handler gives OpenAI's shape.
        app.router.add_route(method, path, handler, expect_handler=expect_handler)
        if method == "GET":  # as `add_get` does: HEAD answers like GET, without the body
            app.router.add_route("HEAD", path, handler, expect_handler=expect_handler)
    return app


class Serving:
    """The app's one `cleanup_ctx`: the shared upstream `ClientSession` (unless one was given)
    and the core's background work (`Core.running`) while the app runs."""

    def __init__(self, session: aiohttp.ClientSession | None, *, health_checks: bool, scrape: bool) -> None:
        self.session = session
        self.health_checks = health_checks
        self.scrape = scrape

    async def __call__(self, app: web.Application) -> AsyncIterator[None]:
        fwd, core = app[FORWARDER], app[CORE]
        # No connection limit here: the admission bounds cap requests per backend, and a limit
        # in the connector would queue requests out of sight of the accounting and the timeouts.
        session = self.session or aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            auto_decompress=False,
            trust_env=False,
            headers={"Accept-Encoding": "identity"},
        )
        fwd.session = session
        try:
            async with core.running(session, health_checks=self.health_checks, scrape=self.scrape):
                assert core.scraper is not None and core.health is not None
                app[SCRAPER], app[HEALTH] = core.scraper, core.health
                yield
        finally:
            if self.session is None:
                await session.close()


# -- the routes, by family --

# Completions: the request path (`forward.py`).


async def chat(request: web.Request) -> web.StreamResponse:
    return await request.app[FORWARDER].handle(request, "chat", "/v1/chat/completions")


async def completions(request: web.Request) -> web.StreamResponse:
    return await request.app[FORWARDER].handle(request, "completions", "/v1/completions")


async def generate(request: web.Request) -> web.StreamResponse:
    _sglang_only(request.app, "/generate")
    return await request.app[FORWARDER].handle(request, "generate", "/generate")


def _sglang_only(app: web.Application, path: str) -> None:
    """A clear 404 for an SGLang-only route when every backend is known to run another engine."""
    engines = [app[SCRAPER].engine(b.name) if SCRAPER in app else None for b in app[TRACKER]]
    if engines and all(e is not None and not e.native_generate for e in engines):
        labels = sorted({e.label for e in engines if e is not None})
        raise NotFound(
            f"{path} is an SGLang route and every backend here runs {', '.join(labels)}: "
            "use /v1/chat/completions or /v1/completions"
        )


# What the backends say of themselves, relayed (`info.py`).


async def models(request: web.Request) -> web.StreamResponse:
    return await list_models(request.app[FORWARDER], request)


async def model_info_route(request: web.Request) -> web.StreamResponse:
    _sglang_only(request.app, request.path)
    return await model_info(request.app[FORWARDER], request)


async def server_info_route(request: web.Request) -> web.StreamResponse:
    _sglang_only(request.app, request.path)
    return await server_info(request.app[FORWARDER], request)


# specroute's own: liveness, readiness, metrics.


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 while some backend is ready (`LoadTracker.ready`); 503 with none, or once a shutdown
    began (balancers send new requests elsewhere)."""
    app = request.app
    if app[SHUTDOWN].started:
        raise ShuttingDown("specroute is shutting down: send new requests elsewhere")
    up = app[TRACKER].ready(app[FORWARDER].clock())
    if not up:
        raise NoBackendAvailable("no healthy backend")
    body: dict[str, object] = {
        "status": "ready",
        "healthy": {pool: sum(b.pool == pool for b in up) for pool in POOLS},
    }
    names = app[CORE].identity.names([b.name for b in up])
    if names is not None:  # `backend_header: false`: the counts per pool only
        body["healthy_backends"] = names
    return web.json_response(body)


async def metrics_route(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("POST", "/v1/chat/completions", chat),
    ("POST", "/v1/completions", completions),
    ("POST", "/generate", generate),
    ("PUT", "/generate", generate),  # SGLang accepts both
    ("GET", "/v1/models", models),
    ("GET", "/model_info", model_info_route),
    ("GET", "/get_model_info", model_info_route),
    ("GET", "/server_info", server_info_route),
    ("GET", "/get_server_info", server_info_route),
    ("GET", "/health", health),
    ("GET", "/ready", ready),
    ("GET", "/metrics", metrics_route),
)
"""Every route but the admin endpoint's (`admin.admin_routes`), with its handler."""


def reopen_decision_log(app: web.Application) -> None:
    """Have the decision log open its path anew (SIGHUP, after an external rotation)."""
    app[CORE].reopen_decision_log()


def make_runner(app: web.Application, *, shutdown_timeout: float = 30.0) -> web.AppRunner:
    """An AppRunner that cancels a handler when its client disconnects (so the upstream request
    is closed at once and SGLang aborts the generation) and closes connections that do not send
    complete headers within `header_timeout_s`."""
    return web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=shutdown_timeout,
        access_log=None,
        # aiohttp arms this timer at connect and after each response, and closes a connection that
        # has not delivered complete headers by then: the slowloris / idle-connection guard.
        keepalive_timeout=app[SETTINGS].header_timeout_s,
        logger=http_log,  # malformed client HTTP is logged without the client's bytes
        # request bodies are decoded by `limits.read_body`, in bounded steps: aiohttp inflated
        # them as they arrived, and the rest of a refused one again while it lingered
        auto_decompress=False,
    )


async def drain(runner: web.AppRunner, timeout_s: float, *, cut_grace_s: float = 0.5) -> None:
    """Stop taking requests and let those in progress finish for up to `timeout_s`; then cancel
    the rest, which closes their upstream requests (SGLang aborts them) and aborts their client
    connections (a client that stopped reading must not hold the process). Then
    `runner.cleanup()` has nothing left to wait for, so a shutdown takes `timeout_s` plus about a
    second, whatever clients do."""
    for site in list(runner.sites):
        await site.stop()
    if runner.server is not None:
        runner.server.pre_shutdown()  # idle keep-alive connections close; busy ones after this answer
    fwd = runner.app[FORWARDER]
    if not fwd.active:
        return
    _, pending = await asyncio.wait(set(fwd.active), timeout=timeout_s)
    if pending:
        log.warning("drain timeout: cutting %d request(s) still in progress", len(pending))
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=cut_grace_s)
