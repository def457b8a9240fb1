"""What every transport of the request path builds from the settings, and runs while it serves.

`build_core` makes the backends' state (`LoadTracker`, with its admission bounds and prefix
indexes), the metrics, admission (`Capacity`), the outlier detector, the memory budget, what
clients may learn of the backends, the per-pool rewrite, and the request path's two halves
(`Tickets`, with the shadow policies and the observers every request's end feeds: acceptance
metrics, profile mismatches, and the decision log while it is open). `serve`'s HTTP app
(`controller.proxy.app`) is built around one `Core`; so is any other transport (an Envoy
ext_proc endpoint picker), which then routes exactly as `serve` does.

`Core.running(session)` is the background work while serving: it opens the decision log
(`settings.decision_log`), runs the health checker and the scraper (`ScrapeLoop`: samples into
the tracker, a reported cap into the admission bounds, a reported in-engine adaptation into
`Core.ladders`), and stops them all on exit. The transport builds its policies through
`Core.ladders.adapt` and gives `Core.rebuild`, called when the eagle pool's ladder changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from controller.proxy.acceptance_metrics import AcceptanceMetrics
from controller.proxy.adaptive import EagleLadders
from controller.proxy.capacity import AdmissionMetrics, Capacity, in_flight_bounds
from controller.proxy.config import Settings
from controller.proxy.decision_record import DecisionLogCollector, DecisionLogger, open_decision_log
from controller.proxy.engines import Engine
from controller.proxy.headers import PoolRewrite
from controller.proxy.health import HealthChecker
from controller.proxy.identity import BackendIdentity
from controller.proxy.load import LoadTracker
from controller.proxy.memory import MemoryBudget
from controller.proxy.metrics import BudgetCollector, Metrics
from controller.proxy.outlier import OutlierDetector
from controller.proxy.scrape import RejectedValuesCollector, ScrapeLoop, apply_reported_cap
from controller.proxy.shadow import ShadowPolicies, build_shadows
from controller.proxy.ticket import AttemptReports, Observer, RequestRecord, Tickets
from policies.base import Policy, Pool
from policies.calibration import MISMATCH_AFTER
from policies.ladder import Reported
from policies.prefix import DEFAULT_CACHE_TOKENS
from policies.profile import Profile, resolve_profile
from policies.registry import PolicyRegistry
from policies.spec import PolicyContext

log = logging.getLogger("specroute")


def policy_context(settings: Settings) -> PolicyContext:
    """Profile (resolved from a path or a built-in name) and seed for building policies."""
    profile = resolve_profile(settings.profile) if settings.profile else None
    return PolicyContext(profile=profile, seed=settings.seed)


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


@dataclass
class Core:
    """One deployment's request path and its shared state (see the module's note)."""

    settings: Settings
    clock: Callable[[], float]
    tracker: LoadTracker
    metrics: Metrics
    capacity: Capacity
    outlier: OutlierDetector
    budget: MemoryBudget
    identity: BackendIdentity
    rewrite: PoolRewrite
    reports: AttemptReports
    tickets: Tickets
    dropped_records: Counter
    """`specroute_decision_log_dropped_records_total`, by reason."""
    ladders: EagleLadders
    """The eagle pool's in-engine adaptive speculation: configured, reported, predicted."""
    rebuild: Callable[[], None] | None = None
    """Rebuilds the running policy through `ladders.adapt` (the transport's; `PolicyAdmin.fresh`)."""
    scraper: ScrapeLoop | None = None
    """The scrape loop while `running` (its engines: `ScrapeLoop.engine`)."""
    health: HealthChecker | None = None
    decision_logs: list[DecisionLogger] = field(default_factory=list)
    """The open decision log (none, or one while running)."""

    @contextlib.asynccontextmanager
    async def running(
        self, session: aiohttp.ClientSession, *, health_checks: bool = True, scrape: bool = True
    ) -> AsyncIterator[None]:
        """The background work while serving (see the module's note)."""
        settings, tracker, clock = self.settings, self.tracker, self.clock
        rewrite = self.rewrite
        self.scraper = scraper = ScrapeLoop(
            tracker,
            session,
            interval_s=settings.scrape_interval_s,
            timeout_s=min(2.0, settings.scrape_stale_after_s),
            clock=clock,
            headers=lambda pool: {"Authorization": auth} if (auth := rewrite.auth_header(pool)) else {},
            engines={b.name: settings.engine_of(b.name) for b in settings.backends()},
            on_capacity=self._reported_cap,
            on_engine=self._engine_found,
            on_adaptive=self._adaptive_reported,
        )
        self.health = checker = HealthChecker(
            tracker,
            session,
            path=settings.health_check_path,
            interval_s=settings.health_check_interval_s,
            timeout_s=settings.health_check_timeout_s,
            unhealthy_threshold=settings.health_check_unhealthy_threshold,
            healthy_threshold=settings.health_check_healthy_threshold,
            engine_of=scraper.engine,
            clock=clock,
        )
        decisions = None
        if settings.decision_log:
            dropped = self.dropped_records
            decisions = open_decision_log(
                settings.decision_log,
                clock,
                on_drop=lambda reason, n: dropped.labels(reason).inc(n),
                max_queued_bytes=settings.decision_log_queue_bytes,
            )
            self.tickets.observers.append(decisions)
            self.decision_logs.append(decisions)
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
                self.tickets.observers.remove(decisions)
                self.decision_logs.remove(decisions)
                await asyncio.to_thread(decisions.log.close)

    def reopen_decision_log(self) -> None:
        """Have the decision log open its path anew (SIGHUP, after an external rotation)."""
        for decisions in self.decision_logs:
            decisions.log.reopen()

    def _reported_cap(self, name: str, cap: int) -> None:
        """A backend reported its running-request cap: it sets the admission bound (unless the
        pool's bound is configured), and waiters get a chance at a larger bound."""
        settings = self.settings

        def bounded(pool: Pool) -> bool:
            return getattr(settings, f"{pool}_backend_max_in_flight") is not None

        margin, replicas = settings.admission_margin, settings.replicas
        if apply_reported_cap(self.tracker, bounded, margin, name, cap, replicas) is not None:
            self.capacity.released(self.tracker.get(name).pool)

    def _adaptive_reported(self, name: str, reported: Reported) -> None:
        """A backend reported its in-engine adaptation: when that changes the eagle pool's ladder,
        the policy is rebuilt to predict it."""
        if self.ladders.report(name, reported) and self.rebuild is not None:
            log.warning(
                "eagle pool: %s (reported by %s): the routing policy is rebuilt to predict it, with "
                "nothing learned",
                self.ladders.describe(), name,
            )  # fmt: skip
            self.rebuild()

    def _engine_found(self, name: str, engine: Engine) -> None:
        """Warn about settings the backend's engine does not honour."""
        if self.settings.spec_details and not engine.spec_details and self.tracker.get(name).pool == "eagle":
            log.info(
                "spec_details: eagle backend %s runs %s, which ignores return_spec_tokens_details; each "
                "request's accept length is read from its answer's metrics.speculative_decoding, which "
                "vLLM adds when started with --per-request-spec-decode-metrics summary",
                name, engine.label,
            )  # fmt: skip


def build_tracker(settings: Settings, profile: Profile | None) -> LoadTracker:
    """The backends' state: both pools, their admission bounds and (with prefix tracking) their
    prefix indexes."""
    tracker = LoadTracker(
        settings.baseline,
        settings.eagle,
        stale_after_s=settings.scrape_stale_after_s,
        panic=settings.panic_routing,
        replicas=settings.replicas,
    )
    tracker.set_bounds(*in_flight_bounds(settings, profile))
    if settings.prefix_tracking:
        tracker.track_prefixes(prefix_capacities(settings, profile, tracker))
    return tracker


def _dropped_records(registry: CollectorRegistry) -> Counter:
    dropped = Counter(
        "specroute_decision_log_dropped_records",
        "Decision-log records not written, by reason (queue_full: the writer fell behind; "
        "write_error: the disk failed or is full; unencodable).",
        ["reason"],
        registry=registry,
    )
    for reason in ("queue_full", "write_error", "unencodable"):
        dropped.labels(reason)
    return dropped


def build_core(
    settings: Settings,
    policy: Policy,
    *,
    registry: PolicyRegistry | None = None,
    metrics_registry: CollectorRegistry | None = None,
    clock: Callable[[], float],
    context: PolicyContext | None = None,
    observers: Sequence[Observer] = (),
    shadows: Sequence[tuple[str, Policy]] | None = None,
) -> Core:
    """`shadows`: (label, policy) pairs; None builds `settings.shadow_policies` with `registry`
    (PolicyError)."""
    ctx = context if context is not None else policy_context(settings)
    tracker = build_tracker(settings, ctx.profile)
    ladders = EagleLadders(settings)
    registry_ = metrics_registry if metrics_registry is not None else CollectorRegistry()
    metrics = Metrics(registry_, tracker, clock=clock)
    if shadows is None:
        if registry is None:
            raise ValueError("build_core needs the policy registry to build settings.shadow_policies")
        shadows = build_shadows(settings.shadow_policies, registry, ladders.adapt(ctx))
    outlier = OutlierDetector(
        tracker,
        consecutive_failures=settings.outlier_consecutive_failures,
        base_s=settings.outlier_base_ejection_s,
        max_s=settings.outlier_max_ejection_s,
        max_ejected_percent=settings.outlier_max_ejected_percent,
    )
    capacity = Capacity(
        tracker,
        AdmissionMetrics(registry_),
        wait_s=settings.admission_wait_s,
        max_waiting=settings.admission_max_waiting,
        clock=clock,
        backoff_s=settings.overload_backoff_s,
    )
    budget = MemoryBudget(settings.memory_budget_bytes)
    registry_.register(BudgetCollector(budget))
    tickets = Tickets(
        policy, tracker, capacity, metrics, clock=clock, seed=settings.seed,
        allow_client_override=settings.allow_client_override, prefix_tracking=settings.prefix_tracking,
        shadows=ShadowPolicies(shadows, metrics), observers=list(observers),
        max_n=settings.max_n, max_prompts_per_request=settings.max_prompts_per_request,
    )  # fmt: skip
    tickets.observers.append(AcceptanceMetrics(registry_, lambda: tickets.policy))
    tickets.observers.append(MismatchWatch(metrics))
    dropped = _dropped_records(registry_)
    decision_logs: list[DecisionLogger] = []
    registry_.register(DecisionLogCollector(decision_logs))
    core = Core(
        settings=settings,
        clock=clock,
        tracker=tracker,
        metrics=metrics,
        capacity=capacity,
        outlier=outlier,
        budget=budget,
        identity=BackendIdentity.from_settings(settings),
        rewrite=PoolRewrite.from_settings(settings),
        reports=AttemptReports(capacity, metrics, clock, outlier),
        tickets=tickets,
        dropped_records=dropped,
        decision_logs=decision_logs,
        ladders=ladders,
    )
    registry_.register(RejectedValuesCollector(lambda: core.scraper))
    return core


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
