"""The aiohttp application: routes, shared state and lifecycle.

`create_app` takes every collaborator (settings, policy, policy registry, optional client
session, clock, metrics registry) so tests build the real app around fakes. One `cleanup_ctx`
opens the shared `ClientSession` (unless one was passed in), runs the health checker and the
backend scraper (`controller.proxy.scrape.ScrapeLoop`, samples into `app[TRACKER]`), and opens and
closes the decision log (`settings.decision_log`, written by `controller.proxy.decision_record`;
`reopen_decision_log` makes it open its path anew). The error middleware passes specroute's
error messages through `controller.proxy.identity` (`errors.CLIENT_TEXT`: backend names hidden
from clients with `backend_header: false`).

Shadow policies (`settings.shadow_policies`, or built ones passed as `shadows=`) are asked by
the `Forwarder` on every request. Further observers: pass `observers=[callable]`, or append to
`app[FORWARDER].observers`; each gets a `RequestRecord` once a request has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from controller.proxy.acceptance_metrics import AcceptanceMetrics
from controller.proxy.adaptive import EagleLadders
from controller.proxy.admin import PolicyAdmin, admin_routes
from controller.proxy.capacity import AdmissionMetrics, Capacity, in_flight_bounds
from controller.proxy.config import Settings
from controller.proxy.decision_record import DecisionLogger, open_decision_log
from controller.proxy.engines import Engine
from controller.proxy.errors import (
    CLIENT_TEXT,
    NoBackendAvailable,
    NotFound,
    ShuttingDown,
    error_middleware,
    expect_handler,
    http_log,
)
from controller.proxy.forward import Forwarder, Observer, RequestRecord
from controller.proxy.headers import BACKEND_HEADER, POOL_HEADER, forwardable
from controller.proxy.health import HealthChecker
from controller.proxy.info import model_info, server_info
from controller.proxy.limits import read_bounded
from controller.proxy.load import LoadTracker
from controller.proxy.memory import keep_heap_small
from controller.proxy.metrics import BudgetCollector, Metrics, RelayCollector
from controller.proxy.outlier import OutlierDetector
from controller.proxy.scrape import ScrapeLoop, apply_reported_cap
from controller.proxy.shadow import ShadowPolicies, build_shadows
from controller.proxy.shutdown import SHUTDOWN, Shutdown, close_after_answer
from policies.base import POOLS, Policy, Pool
from policies.calibration import MISMATCH_AFTER
from policies.ladder import Reported
from policies.prefix import DEFAULT_CACHE_TOKENS
from policies.profile import Profile, resolve_profile
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
DECISION_LOGS = web.AppKey("decision_logs", list[DecisionLogger])
"""The open decision log (none, or one while the app runs)."""


def policy_context(settings: Settings) -> PolicyContext:
    """Profile (resolved from a path or a built-in name) and seed for building policies."""
    profile = resolve_profile(settings.profile) if settings.profile else None
    return PolicyContext(profile=profile, seed=settings.seed)


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
    tracker = LoadTracker(
        settings.baseline,
        settings.eagle,
        stale_after_s=settings.scrape_stale_after_s,
        panic=settings.panic_routing,
        replicas=settings.replicas,
    )
    tracker.set_bounds(*in_flight_bounds(settings, ctx.profile))
    if settings.prefix_tracking:
        tracker.track_prefixes(prefix_capacities(settings, ctx.profile, tracker))
    ladders = EagleLadders(settings)
    registry_ = metrics_registry if metrics_registry is not None else CollectorRegistry()
    metrics = Metrics(registry_, tracker, clock=clock)
    if shadows is None:
        shadows = build_shadows(settings.shadow_policies, registry, ladders.adapt(ctx))
    fwd = Forwarder(
        settings,
        policy,
        tracker,
        metrics,
        clock=clock,
        observers=list(observers),
        shadows=ShadowPolicies(shadows, metrics),
        outlier=OutlierDetector(
            tracker,
            consecutive_failures=settings.outlier_consecutive_failures,
            base_s=settings.outlier_base_ejection_s,
            max_s=settings.outlier_max_ejection_s,
            max_ejected_percent=settings.outlier_max_ejected_percent,
        ),
        capacity=Capacity(
            tracker,
            AdmissionMetrics(registry_),
            wait_s=settings.admission_wait_s,
            max_waiting=settings.admission_max_waiting,
            clock=clock,
            backoff_s=settings.overload_backoff_s,
        ),
    )
    registry_.register(BudgetCollector(fwd.budget))
    registry_.register(RelayCollector(fwd.relays))
    fwd.observers.append(AcceptanceMetrics(registry_, lambda: fwd.policy))
    fwd.observers.append(MismatchWatch(metrics))
    app[SETTINGS] = settings
    if not fwd.identity.show:
        app[CLIENT_TEXT] = fwd.identity.for_clients
    app[TRACKER] = tracker
    app[METRICS] = metrics
    app[FORWARDER] = fwd
    app[ADMIN] = PolicyAdmin(fwd, registry, ctx, adapt=ladders.adapt)
    if ladders.pool_ladder() is not None:  # backend_adaptive: the policy predicts the ladder's speed
        app[ADMIN].fresh()
        log.info("eagle pool: %s", ladders.describe())
    app[SHUTDOWN] = Shutdown(clock)
    app.on_response_prepare.append(close_after_answer)
    app[DECISION_LOGS] = open_logs = []
    dropped = Counter(
        "specroute_decision_log_dropped_records",
        "Decision-log records not written, by reason (queue_full: the writer fell behind; "
        "write_error: the disk failed or is full; unencodable).",
        ["reason"],
        registry=registry_,
    )
    for reason in ("queue_full", "write_error", "unencodable"):
        dropped.labels(reason)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        own = session is None
        # No connection limit here: the admission bounds cap requests per backend, and a limit
        # in the connector would queue requests out of sight of the accounting and the timeouts.
        fwd.session = session or aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            auto_decompress=False,
            trust_env=False,
            headers={"Accept-Encoding": "identity"},
        )
        scraper = ScrapeLoop(
            tracker,
            fwd.session,
            interval_s=settings.scrape_interval_s,
            timeout_s=min(2.0, settings.scrape_stale_after_s),
            clock=clock,
            headers=lambda pool: {"Authorization": auth} if (auth := fwd.auth_header(pool)) else {},
            engines={b.name: settings.engine_of(b.name) for b in settings.backends()},
            on_capacity=lambda name, cap: _reported_cap(settings, fwd, name, cap),
            on_engine=lambda name, engine: _engine_found(settings, tracker, name, engine),
            on_adaptive=lambda name, reported: _adaptive_reported(app[ADMIN], ladders, name, reported),
        )
        app[SCRAPER] = scraper
        checker = HealthChecker(
            tracker,
            fwd.session,
            path=settings.health_check_path,
            interval_s=settings.health_check_interval_s,
            timeout_s=settings.health_check_timeout_s,
            unhealthy_threshold=settings.health_check_unhealthy_threshold,
            healthy_threshold=settings.health_check_healthy_threshold,
            engine_of=scraper.engine,
            clock=clock,
        )
        app[HEALTH] = checker
        decisions = None
        if settings.decision_log:
            decisions = open_decision_log(
                settings.decision_log, clock, on_drop=lambda reason, n: dropped.labels(reason).inc(n)
            )
            fwd.observers.append(decisions)
            open_logs.append(decisions)
        tasks = []
        if health_checks:
            tasks.append(asyncio.create_task(checker.run()))
        if scrape:
            tasks.append(asyncio.create_task(scraper.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if decisions is not None:
                fwd.observers.remove(decisions)
                open_logs.remove(decisions)
                await asyncio.to_thread(decisions.log.close)
            if own:
                await fwd.session.close()

    app.cleanup_ctx.append(lifecycle)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await fwd.handle(request, "chat", "/v1/chat/completions")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await fwd.handle(request, "completions", "/v1/completions")

    def sglang_only(path: str) -> None:
        """A clear 404 for an SGLang-only route when every backend is known to run another engine."""
        engines = [app[SCRAPER].engine(b.name) if SCRAPER in app else None for b in tracker]
        if engines and all(e is not None and not e.native_generate for e in engines):
            labels = sorted({e.label for e in engines if e is not None})
            raise NotFound(
                f"{path} is an SGLang route and every backend here runs {', '.join(labels)}: "
                "use /v1/chat/completions or /v1/completions"
            )

    async def generate(request: web.Request) -> web.StreamResponse:
        sglang_only("/generate")
        return await fwd.handle(request, "generate", "/generate")

    async def models(request: web.Request) -> web.StreamResponse:
        return await list_models(fwd, request)

    async def model_info_route(request: web.Request) -> web.StreamResponse:
        sglang_only(request.path)
        return await model_info(fwd, request)

    async def server_info_route(request: web.Request) -> web.StreamResponse:
        sglang_only(request.path)
        return await server_info(fwd, request)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(request: web.Request) -> web.Response:
        if app[SHUTDOWN].started:
            raise ShuttingDown("specroute is shutting down: send new requests elsewhere")
        now = clock()
        healthy = [b for b in tracker if b.healthy and not b.ejected(now)]
        if not healthy:
            raise NoBackendAvailable("no healthy backend")
        body: dict[str, object] = {
            "status": "ready",
            "healthy": {pool: sum(b.pool == pool for b in healthy) for pool in POOLS},
        }
        names = fwd.identity.names([b.name for b in healthy])
        if names is not None:  # `backend_header: false`: the counts per pool only
            body["healthy_backends"] = names
        return web.json_response(body)

    async def metrics_route(request: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    routes: list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
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
    ]
    routes += [(r.method, r.path, r.handler) for r in admin_routes(app[ADMIN])]
    for method, path, handler in routes:
        # A bogus `Expect` is answered before any middleware runs: our handler gives OpenAI's shape.
        app.router.add_route(method, path, handler, expect_handler=expect_handler)
        if method == "GET":  # as `add_get` does: HEAD answers like GET, without the body
            app.router.add_route("HEAD", path, handler, expect_handler=expect_handler)
    return app


class MismatchWatch:
    """Reports a policy's profile mismatches (`policies.calibration`: a pool rebased because its
    speeds were off by more than 2x) as a metric and a log line, once each."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._seen: dict[tuple[int, Pool], int] = {}

    def __call__(self, record: RequestRecord) -> None:
        calibration = getattr(record.policy, "calibration", None)
        counts = getattr(calibration, "mismatches", None)
        if not isinstance(counts, dict):
            return
        name = record.chosen.policy or type(record.policy).__name__
        for pool, count in counts.items():
            key = (id(calibration), pool)
            seen = self._seen.get(key, 0)
            if count > seen:
                self._seen[key] = count
                self.metrics.profile_mismatches.labels(name, pool).inc(count - seen)
                factor = calibration.mismatch_factor.get(pool)  # type: ignore[union-attr]
                log.warning(
                    "policy %s: the %s pool runs %.2fx the speed its profile says (median of its last "
                    "%d+ outcomes): the profile does not fit these servers; calibration rebased to the "
                    "observed speed (measure them with `specroute bench --profile-out`)",
                    name, pool, factor or 0.0, MISMATCH_AFTER,
                )  # fmt: skip


def _reported_cap(settings: Settings, fwd: Forwarder, name: str, cap: int) -> None:
    """A backend reported its running-request cap: it sets the admission bound (unless the pool's
    bound is configured), and waiters get a chance at a larger bound."""

    def bounded(pool: Pool) -> bool:
        return getattr(settings, f"{pool}_backend_max_in_flight") is not None

    if apply_reported_cap(fwd.tracker, bounded, settings.admission_margin, name, cap) is not None:
        fwd.capacity.released(fwd.tracker.get(name).pool)


def _engine_found(settings: Settings, tracker: LoadTracker, name: str, engine: Engine) -> None:
    """Warn about settings the backend's engine does not honour."""
    if settings.spec_details and not engine.spec_details and tracker.get(name).pool == "eagle":
        log.warning(
            "spec_details is on but eagle backend %s runs %s, which has no per-request speculative "
            "details (it ignores the field): its accept length comes from /metrics instead",
            name, engine.label,
        )  # fmt: skip


def _adaptive_reported(admin: PolicyAdmin, ladders: EagleLadders, name: str, reported: Reported) -> None:
    """A backend reported its in-engine adaptation: when that changes the eagle pool's ladder, the
    policy is rebuilt to predict it."""
    if ladders.report(name, reported):
        log.warning(
            "eagle pool: %s (reported by %s): routing policy %s rebuilt to predict it, with nothing learned",
            ladders.describe(), name, admin.name,
        )  # fmt: skip
        admin.fresh()


def reopen_decision_log(app: web.Application) -> None:
    """Have the decision log open its path anew (SIGHUP, after an external rotation)."""
    for decisions in app[DECISION_LOGS]:
        decisions.log.reopen()


def prefix_capacities(settings: Settings, profile: Profile | None, tracker: LoadTracker) -> dict[str, int]:
    """Each backend's prefix index capacity in tokens: `prefix_cache_tokens`, else its pool's
    `cache_tokens` in the profile, else `prefixes.DEFAULT_CACHE_TOKENS`."""
    out = {}
    for b in tracker:
        tokens = settings.prefix_cache_tokens
        if tokens is None and profile is not None and b.pool in profile.modes:
            tokens = profile.modes[b.pool].cache_tokens
        out[b.name] = DEFAULT_CACHE_TOKENS if tokens is None else tokens
    return out


async def list_models(fwd: Forwarder, request: web.Request) -> web.StreamResponse:
    """Relay `GET /v1/models` from the first healthy backend that answers (baseline first)."""
    assert fwd.session is not None
    headers = {}
    if "Authorization" in request.headers:
        headers["Authorization"] = forwardable("Authorization", request.headers["Authorization"])
    timeout = aiohttp.ClientTimeout(
        total=fwd.settings.health_check_timeout_s + fwd.settings.connect_timeout_s,
        sock_connect=fwd.settings.connect_timeout_s,
    )
    candidates = sorted(fwd.tracker.usable(fwd.clock()), key=lambda b: b.pool != "baseline")
    for b in candidates:
        auth = fwd.auth_header(b.pool)
        hdrs = {**headers, "Authorization": auth} if auth else headers
        try:
            async with fwd.session.get(
                b.url + "/v1/models", headers=hdrs, timeout=timeout, allow_redirects=False
            ) as resp:
                body = await read_bounded(resp, fwd.settings.response_limit_bytes)
                if resp.status >= 500 or 300 <= resp.status < 400:
                    continue
                shown: dict[str, str] = {POOL_HEADER: b.pool}
                if fwd.settings.backend_header:
                    shown[BACKEND_HEADER] = b.name
                return web.Response(
                    status=resp.status, body=body, content_type=resp.content_type, headers=shown
                )
        except (aiohttp.ClientError, TimeoutError, OSError):
            continue
    raise NoBackendAvailable("no healthy backend answered /v1/models")


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
