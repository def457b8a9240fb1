"""Route one completion request and hand it to its lifecycle; the proxy's side of a request.

How it works:
1. Read the body within the byte, JSON-structure, compression-ratio and memory budgets
   (`limits.py`, `memory.py`; bad input -> 400/413, no memory -> 503), parse it once, build a
   `RequestInfo` (`request_info`), wait if every backend it may use is full (`capacity.py`),
   take a `LoadView` and ask the routing core (`policies.routing.Router`: `x-specroute-mode`,
   the policy, the backend within the pool, the fallback) -- and, in the same synchronous step,
   create the request's `RequestLifecycle`, which takes the slot.
2. The lifecycle (`lifecycle.py`) opens the upstream request (`upstream.py`), fails over once
   where that is safe, and relays the answer (`sse.py` reads the stream).
3. `finally` (every path, including client disconnect = handler cancellation): the lifecycle
   releases what it holds and builds the `Outcome`, which goes to the policy that chose the
   request (and to the shadow policies, asked right after the live decision with the same
   inputs), the metrics and the observers (decision log).

Every attempt's fate goes to the outlier detector, as `upstream.py`'s table says: what a client
can cause (4xx, queue full, a long generation) is never held against a backend.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from controller.proxy.capacity import AdmissionMetrics, Capacity
from controller.proxy.config import Settings
from controller.proxy.errors import BadRequest, NoBackendAvailable, SpecrouteError
from controller.proxy.headers import HINT_HEADER, MODE_HEADER, client_headers, upstream_headers
from controller.proxy.identity import BackendIdentity
from controller.proxy.lifecycle import RequestLifecycle
from controller.proxy.limits import BodyGate, JsonBudget, read_body
from controller.proxy.load import BackendState, LoadTracker
from controller.proxy.memory import Charge, MemoryBudget
from controller.proxy.metrics import Metrics
from controller.proxy.native import generate_max_tokens
from controller.proxy.outlier import OutlierDetector
from controller.proxy.prefixes import prompt_blocks
from controller.proxy.request import estimate_prompt_tokens, parse_body, parse_small_body
from controller.proxy.shadow import ShadowChoice, ShadowPolicies
from controller.proxy.upstream import COUNTED, UpstreamFailure
from controller.proxy.validate import check_sequences
from controller.proxy.watchdog import RelayWatchdog
from policies.base import (
    Decision,
    EndpointKind,
    InvalidDecision,
    LoadView,
    NoHealthyBackend,
    Outcome,
    Policy,
    Pool,
    RequestInfo,
    parse_pool,
    reads_features,
)
from policies.features import extract_features
from policies.routing import Router

log = logging.getLogger("specroute.forward")

_HINT_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """Everything observers (decision log, shadow policies) get once a request has ended."""

    request: RequestInfo
    view: LoadView
    decision: Decision
    """The final decision (after a failover, the backend that actually served)."""
    chosen: Decision
    """What the policy (or the client override) originally decided."""
    outcome: Outcome
    http_status: int
    policy: Policy
    shadow: tuple[ShadowChoice, ...] = ()
    """What each shadow policy chose for this request (same inputs as `chosen`)."""
    arrived_at: float | None = None
    """When the handler started (the proxy's clock); `outcome.started_at` is the decision."""


Observer = Callable[[RequestRecord], None]


def request_info(
    body: Mapping[str, Any],
    endpoint: EndpointKind,
    headers: Mapping[str, str],
    allow_override: bool,
    features: bool = True,
) -> RequestInfo:
    """What the policy may know of a request; its content `features` only when asked (they cost
    6-25 us, and only a content-aware policy reads them)."""
    if endpoint == "generate":
        max_tokens = generate_max_tokens(body)
    else:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        max_tokens = None
    forced: Pool | None = None
    mode = headers.get(MODE_HEADER)
    if mode is not None and allow_override:
        try:
            forced = parse_pool(mode.strip().lower())
        except ValueError:
            raise BadRequest(f"{MODE_HEADER} must be 'baseline' or 'eagle', got {mode[:40]!r}") from None
    hint = headers.get(HINT_HEADER)
    if hint is not None and not _HINT_RE.fullmatch(hint):
        hint = None
    return RequestInfo(
        endpoint=endpoint,
        stream=body.get("stream") is True,
        prompt_tokens=estimate_prompt_tokens(body, endpoint),
        max_tokens=max_tokens,
        hint=hint,
        forced_pool=forced,
        features=extract_features(body, endpoint) if features else None,
    )


# --- the forwarder ----------------------------------------------------------------------


@dataclass(slots=True)
class _Routed:
    """A request up to its decision (what `finally` needs besides the lifecycle)."""

    info: RequestInfo
    view: LoadView
    chosen: Decision
    policy: Policy
    started: float


class Forwarder:
    """Routes and forwards completion requests. `policy` may be swapped at any time (hot reload):
    each request keeps the policy object that chose it."""

    def __init__(
        self,
        settings: Settings,
        policy: Policy,
        tracker: LoadTracker,
        metrics: Metrics,
        *,
        clock: Callable[[], float],
        observers: list[Observer] | None = None,
        shadows: ShadowPolicies | None = None,
        outlier: OutlierDetector | None = None,
        capacity: Capacity | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.tracker = tracker
        self.metrics = metrics
        self.clock = clock
        self.outlier = outlier
        self.capacity = capacity or Capacity(
            tracker, AdmissionMetrics(CollectorRegistry()), wait_s=settings.admission_wait_s,
            max_waiting=settings.admission_max_waiting, clock=clock, backoff_s=settings.overload_backoff_s,
        )  # fmt: skip
        self.budget = budget or MemoryBudget(settings.memory_budget_bytes)
        self.body_gate = BodyGate(settings.body_read_concurrency, settings.admission_wait_s, clock)
        self.identity = BackendIdentity.from_settings(settings)
        """What clients may learn of the backends: every client-bound message passes it."""
        self.active: set[asyncio.Task[Any]] = set()
        """The handler tasks of requests in progress (a shutdown cancels those left after draining)."""
        self.relays: set[RelayWatchdog] = set()
        """The watchdogs of the streams being relayed (`specroute_client_writes_blocked` reads them)."""
        self.observers: list[Observer] = observers if observers is not None else []
        self.shadows = shadows if shadows else None
        self.session: aiohttp.ClientSession | None = None
        self.cache_reporters: set[str] = set()
        """Backends that have reported `cached_tokens` (SGLang's `--enable-cache-report` is on)."""
        self.router = Router(settings.seed)
        """The routing core (`policies.routing`): override, fallback, backend choice, failover."""
        self.client_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout_s, connect=None, sock_read=None
        )
        self._model: dict[str, str | None] = {
            "baseline": settings.baseline_model,
            "eagle": settings.eagle_model,
        }
        self._auth: dict[str, str | None] = {
            pool: f"Bearer {key.get_secret_value()}" if key is not None else None
            for pool, key in (("baseline", settings.baseline_api_key), ("eagle", settings.eagle_api_key))
        }

    def features_wanted(self) -> bool:
        """Whether the live policy or a shadow policy may read `RequestInfo.features` (else the
        request's features are not extracted)."""
        if reads_features(self.policy):
            return True
        return self.shadows is not None and any(reads_features(p) for _, p in self.shadows.policies)

    def auth_header(self, pool: Pool) -> str | None:
        """The Authorization header configured for `pool` (None: forward the client's)."""
        return self._auth[pool]

    def response_headers(self, resp: aiohttp.ClientResponse, decision: Decision) -> CIMultiDict[str]:
        return client_headers(resp.headers, decision, show_backend=self.settings.backend_header)

    # -- what attempts tell the outlier detector and the capacity --

    def _failed(self, backend: BackendState, why: str) -> None:
        if self.outlier is not None and self.outlier.failure(backend, self.clock(), why):
            self.metrics.ejection(backend.pool, backend.name)

    def attempt_failed(self, backend: BackendState, failure: UpstreamFailure, sent_at: float) -> None:
        """An attempt failed before the commit (see `upstream.py` for what counts)."""
        if failure.kind == "overload":
            self.capacity.back_off(backend, self.clock())
        elif failure.kind == "timeout":
            self.attempt_timed_out(backend, sent_at, failure.error.message)
        elif failure.kind in COUNTED:
            self._failed(backend, failure.error.message)

    def attempt_timed_out(self, backend: BackendState, sent_at: float | None, why: str) -> None:
        if self.outlier is not None and self.outlier.timeout(backend, sent_at or 0.0, self.clock(), why):
            self.metrics.ejection(backend.pool, backend.name)

    def attempt_failed_after_commit(self, backend: BackendState, why: str) -> None:
        """A stream broke, ended early or broke the protocol after its first byte."""
        self._failed(backend, why)

    def attempt_succeeded(self, backend: BackendState) -> None:
        if self.outlier is not None:
            self.outlier.success(backend, self.clock())

    def report_progress(self, backend: BackendState) -> None:
        if self.outlier is not None:
            self.outlier.progress(backend, self.clock())

    # -- deciding --

    def decide(self, policy: Policy, info: RequestInfo, view: LoadView, now: float) -> Decision:
        """The routing core's decision, its errors translated into HTTP ones."""
        try:
            return self.router.decide(policy, info, view, now)
        except NoHealthyBackend as e:
            raise NoBackendAvailable(str(e)) from None
        except InvalidDecision as e:
            raise SpecrouteError(f"routing policy {policy.name!r} {e}") from None
        except Exception:
            log.exception("policy %r failed in choose()", policy.name)
            raise SpecrouteError(f"routing policy {policy.name!r} failed") from None

    def failover_target(self, failed: BackendState, tried: set[str], forced: bool) -> BackendState | None:
        alt = self.router.failover(self.tracker.view(self.clock()), failed.name, tried, forced)
        return None if alt is None else self.tracker.get(alt.name)

    # -- forwarding --

    def for_pool(
        self, pool: Pool, raw: bytes, body: dict[str, Any], headers: CIMultiDict[str]
    ) -> tuple[bytes, CIMultiDict[str]]:
        model = self._model[pool]
        if model is not None:
            raw = json.dumps({**body, "model": model}).encode()
        auth = self._auth[pool]
        if auth is not None:
            headers = headers.copy()
            headers["Authorization"] = auth
        return raw, headers

    async def read_body(self, request: web.Request, charge: Charge | None = None) -> bytes:
        """The request body within `body_limit_bytes`, the JSON budget, the compression ratio,
        the memory budget (`charge`; a large body waits up to `admission_wait_s` for room) and
        `body_timeout_s`; a costly one in its turn at the `BodyGate` (`body_read_concurrency`)."""
        s = self.settings
        budget = JsonBudget(s.body_max_json_values, s.body_max_json_containers)
        async with self.body_gate.turn(request):
            return await read_body(
                request, limit=s.body_limit_bytes, budget=budget, timeout_s=s.body_timeout_s, charge=charge,
                max_ratio=s.body_max_compression_ratio, wait_s=s.admission_wait_s, clock=self.clock,
            )  # fmt: skip

    async def handle(self, request: web.Request, endpoint: EndpointKind, path: str) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self.active.add(task)
        charge = Charge(self.budget)
        try:
            return await self._handle(request, endpoint, path, charge)
        finally:
            charge.release()
            self.active.discard(task)

    async def _route(
        self, request: web.Request, endpoint: EndpointKind, path: str, charge: Charge
    ) -> tuple[_Routed, RequestLifecycle]:
        """Read, parse, admit and decide; the lifecycle made in the deciding step."""
        try:
            raw = await self.read_body(request, charge)
            body = parse_small_body(raw, endpoint)  # without a coroutine
            if body is None:
                body = await parse_body(raw, endpoint)
            settings = self.settings  # n and prompt lists within max_n, max_prompts_per_request
            check_sequences(body, endpoint, settings.max_n, settings.max_prompts_per_request)
            info = request_info(
                body, endpoint, request.headers, self.settings.allow_client_override, self.features_wanted()
            )
            blocks = await prompt_blocks(body, endpoint, len(raw)) if self.settings.prefix_tracking else ()
            headers = upstream_headers(request.headers)
            if self.settings.log_bodies:
                log.info("request %s %s", path, raw[:65536].decode(errors="replace"))
            if self.capacity.blocked(info.forced_pool, now := self.clock()):  # else no coroutine
                await self.capacity.admit(info.forced_pool, now)
            policy = self.policy
            started = self.clock()
            view = self.tracker.view(started, blocks, info.prompt_tokens)
            chosen = self.decide(policy, info, view, started)
        except SpecrouteError as e:
            self.metrics.reject(e.status)
            raise
        # Same synchronous step as the decision: no await between choose() and the reservation.
        run = RequestLifecycle(self, request, info, body, raw, path, chosen, headers, blocks, charge)
        return _Routed(info, view, chosen, policy, started), run

    async def _handle(
        self, request: web.Request, endpoint: EndpointKind, path: str, charge: Charge
    ) -> web.StreamResponse:
        arrived = self.clock()
        routed, run = await self._route(request, endpoint, path, charge)
        shadow: tuple[ShadowChoice, ...] = ()
        try:
            self.metrics.decision(routed.policy.name, routed.chosen.pool, routed.chosen.reason)
            if self.shadows is not None:
                shadow = self.shadows.decide(routed.info, routed.view, routed.started, routed.chosen)
            return await run.run()
        finally:
            outcome = run.finish(routed.started, self.clock())
            try:
                self._observe(routed, run, outcome, shadow, arrived)
            except Exception:  # a request's end must never fail (its slot is released already)
                log.exception("recording the outcome of a request failed")

    def _observe(
        self,
        routed: _Routed,
        run: RequestLifecycle,
        outcome: Outcome,
        shadow: tuple[ShadowChoice, ...],
        arrived: float,
    ) -> None:
        policy = routed.policy
        try:
            policy.observe(outcome)
        except Exception:
            log.exception("policy %r failed in observe()", policy.name)
        if self.shadows is not None:
            self.shadows.observe(outcome)
        metrics = self.metrics
        metrics.request_done(run.decision.pool, run.decision.backend, run.status)
        metrics.outcome(policy.name, outcome)
        if outcome.cached_tokens is not None and run.status == "ok":
            predicted = believed_cached(routed.view, run.decision)
            metrics.prefix_outcome(
                run.decision.pool, run.decision.backend, predicted, outcome.cached_tokens, run.prompt_tokens
            )
        if run.sent_at is not None:
            metrics.proxy_overhead(max(0.0, run.sent_at - arrived))
        if self.observers:
            record = RequestRecord(
                routed.info, routed.view, run.decision, routed.chosen, outcome, run.http_status, policy,
                shadow, arrived,
            )  # fmt: skip
            for observer in self.observers:
                try:
                    observer(record)
                except Exception:
                    log.exception("request observer failed")


def believed_cached(view: LoadView, decision: Decision) -> int:
    """The prompt tokens the view believed cached on the backend that served."""
    for b in view.pool(decision.pool).backends:
        if b.name == decision.backend:
            return b.cached_tokens
    return 0
