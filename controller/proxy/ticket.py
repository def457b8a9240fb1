"""The request path without its transport: from a request's body to its `Ticket`, and from what
the transport saw to the request's `Outcome`.

How it works: `serve`'s HTTP handler (`controller.proxy.forward`) and any other transport (an
Envoy ext_proc endpoint picker, say) take a request through the same steps of one `Tickets`:

front half
1. `await tickets.describe(raw, endpoint, headers, peer)`: the body bytes parsed as JSON and
   checked for the endpoint (400 otherwise), the `RequestInfo` a policy sees (with the sequences
   the backend will run, `controller.proxy.validate.check_sequences`, and who sent it,
   `client_of`), and the prompt's block fingerprint (the prefix index's), as a `Described`
   (`headers`: any mapping of header names, case-insensitive, to values; `peer`: the client's
   address, if known).
2. `await tickets.admit(info)`: returns at once unless every backend the request may use is
   full (for its sequences); then it waits, bounded, or raises `Overloaded` (429). A request
   that runs more sequences than any of those backends takes at once gets a 400.
3. `tickets.issue(info, blocks, arrived_at)`: the view, the decision (`policies.routing.Router`),
   the reservation of the chosen backend (one slot per sequence) and the shadow policies'
   choices, in one synchronous step (no other request can see a stale count), as a `Ticket`.

back half
4. The transport sends the request to the ticket's backend (`Ticket.backend`, its `url`). An
   attempt that fails before anything reached the client may move the ticket once:
   `Ticket.failover_target`, then `Ticket.move`. Each attempt's fate goes to `AttemptReports`
   as it is known (the outlier detector, the queue-full back-off).
5. `Ticket.finish` with a `Result`, once, on every path: the slot and the memory the ticket holds
   are released, the `Outcome` is built, and it goes to `policy.observe`, the shadow policies,
   the metrics and the observers (the decision log: a `RequestRecord`). A second call returns
   the first `Outcome`.

A step that refuses the request raises a `SpecrouteError` (its HTTP status and OpenAI-shaped
body) and counts it in `specroute_rejected_requests_total`. Nothing here imports aiohttp.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from controller.proxy.capacity import Capacity
from controller.proxy.errors import BadRequest, NoBackendAvailable, SpecrouteError
from controller.proxy.generate import generate_max_tokens
from controller.proxy.headers import HINT_HEADER, MODE_HEADER
from controller.proxy.load import BackendState, LoadTracker, Reservation
from controller.proxy.memory import Charge
from controller.proxy.metrics import Metrics
from controller.proxy.outlier import OutlierDetector
from controller.proxy.prefixes import prompt_blocks
from controller.proxy.request import estimate_prompt_tokens, parse_body, parse_small_body
from controller.proxy.shadow import ShadowChoice, ShadowPolicies
from controller.proxy.sse import as_count
from controller.proxy.validate import check_sequences
from policies.base import (
    Decision,
    EndpointKind,
    InvalidDecision,
    LoadView,
    NoHealthyBackend,
    Outcome,
    OutcomeStatus,
    Policy,
    Pool,
    RequestInfo,
    parse_pool,
    reads_features,
)
from policies.features import extract_features, stable_hash
from policies.routing import Router

log = logging.getLogger("specroute.forward")

_HINT_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")


def request_info(
    body: Mapping[str, Any],
    endpoint: EndpointKind,
    headers: Mapping[str, str],
    allow_override: bool,
    features: bool = True,
    *,
    sequences: int = 1,
    client: int = 0,
) -> RequestInfo:
    """What the policy may know of a request; its content `features` only when asked (only a
    content-aware policy reads them). `sequences` and `client`: see `RequestInfo`."""
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
        client=client,
        sequences=sequences,
    )


def client_of(headers: Mapping[str, str], peer: str | None) -> int:
    """Who sent a request, as `RequestInfo.client`: a stable hash of its `Authorization` header
    when it has one (its API key), else of `peer` (the address it came from), else 0 (unknown).
    A hash, never the key: it goes into the policy's learned state."""
    key = headers.get("authorization")
    if key:
        return stable_hash("key\0" + key)
    return stable_hash("peer\0" + peer) if peer else 0


def believed_cached_on(view: LoadView, decision: Decision) -> int:
    """The prompt tokens `view` believed cached on the backend `decision` names."""
    for b in view.pool(decision.pool).backends:
        if b.name == decision.backend:
            return b.cached_tokens
    return 0


@dataclass(frozen=True, slots=True)
class Described:
    """A request as the front half read it (`Tickets.describe`)."""

    body: dict[str, Any]
    """The parsed JSON body (what is forwarded, with the transport's changes)."""
    info: RequestInfo
    blocks: tuple[int, ...]
    """The prompt's block fingerprint (`policies.prefix.fingerprint`; empty: none to track)."""


@dataclass(frozen=True, slots=True)
class Result:
    """What the transport saw of a request, handed to `Ticket.finish` once it has ended. Times
    are on the clock the `Tickets` was given."""

    status: OutcomeStatus
    ended_at: float
    http_status: int = 0
    """The status the client was answered with (0: none was sent)."""
    sent_at: float | None = None
    """When the request was first handed to a backend connection (None: never)."""
    first_byte_at: float | None = None
    """When a stream's first event arrived (None: not a stream, or none arrived)."""
    completion_tokens: int | None = None
    accept_length: float | None = None
    """Tokens per verify step the eagle backend reported for this request, or None."""
    cached_tokens: int | None = None
    """The prompt tokens the backend reported cached, None when its answer did not say."""
    prompt_tokens: int | None = None
    """The prompt tokens the backend reported (None: its answer carried no usage)."""
    client_blocked_s: float = 0.0
    """Seconds the relay spent blocked writing to a client slower than the stream (every write
    it waited on, the last one included)."""


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
    """When the request arrived (the proxy's clock); `outcome.started_at` is the decision."""


Observer = Callable[[RequestRecord], None]


class AttemptReports:
    """Where a transport reports each attempt's fate as soon as it is known (`upstream.py`'s
    table says which failures count): the outlier detector, and the back-off of a backend that
    said its queue is full (capacity, never a failure)."""

    def __init__(
        self,
        capacity: Capacity,
        metrics: Metrics,
        clock: Callable[[], float],
        outlier: OutlierDetector | None = None,
    ) -> None:
        self.capacity = capacity
        self.metrics = metrics
        self.clock = clock
        self.outlier = outlier

    def overloaded(self, backend: BackendState) -> None:
        self.capacity.back_off(backend, self.clock())

    def failed(self, backend: BackendState, why: str) -> None:
        """A connection refused, a 5xx, a broken stream, a protocol error (before or after the
        first byte)."""
        if self.outlier is not None and self.outlier.failure(backend, self.clock(), why):
            self.metrics.ejection(backend.pool, backend.name)

    def timed_out(self, backend: BackendState, sent_at: float | None, why: str) -> None:
        """Counted only when the backend made no progress for anyone since `sent_at`."""
        if self.outlier is not None and self.outlier.timeout(backend, sent_at or 0.0, self.clock(), why):
            self.metrics.ejection(backend.pool, backend.name)

    def succeeded(self, backend: BackendState) -> None:
        if self.outlier is not None:
            self.outlier.success(backend, self.clock())

    def progressed(self, backend: BackendState) -> None:
        """The backend answered (a first byte): it is not slow for everyone."""
        if self.outlier is not None:
            self.outlier.progress(backend, self.clock())


class Tickets:
    """The front half and the back half of the request path (see the module's note). `policy`
    may be swapped at any time (hot reload): each ticket keeps the policy that chose it."""

    def __init__(
        self,
        policy: Policy,
        tracker: LoadTracker,
        capacity: Capacity,
        metrics: Metrics,
        *,
        clock: Callable[[], float],
        seed: int = 0,
        allow_client_override: bool = False,
        prefix_tracking: bool = True,
        shadows: ShadowPolicies | None = None,
        observers: list[Observer] | None = None,
        max_n: int = 2**31,
        max_prompts_per_request: int = 2**31,
    ) -> None:
        self.policy = policy
        self.max_n = max_n
        self.max_prompts_per_request = max_prompts_per_request
        """A request's `n` and prompts (`validate.check_sequences`: 400 above)."""
        self.tracker = tracker
        self.capacity = capacity
        self.metrics = metrics
        self.clock = clock
        self.allow_client_override = allow_client_override
        self.prefix_tracking = prefix_tracking
        self.shadows = shadows if shadows else None
        self.observers: list[Observer] = observers if observers is not None else []
        self.router = Router(seed)
        """The routing core (`policies.routing`): override, fallback, backend choice, failover."""
        self.cache_reporters: set[str] = set()
        """Backends that have reported `cached_tokens` (SGLang's `--enable-cache-report` is on)."""

    # -- the front half --

    def _rejected(self, error: SpecrouteError) -> None:
        self.metrics.reject(error.status)

    def features_wanted(self) -> bool:
        """Whether the live policy or a shadow policy may read `RequestInfo.features` (else the
        request's features are not extracted)."""
        if reads_features(self.policy):
            return True
        return self.shadows is not None and any(reads_features(p) for _, p in self.shadows.policies)

    async def describe(
        self, raw: bytes, endpoint: EndpointKind, headers: Mapping[str, str], peer: str | None = None
    ) -> Described:
        """The body parsed and checked for `endpoint` (`controller.proxy.request`; 400
        otherwise), the `RequestInfo` a policy sees, and the prompt's block fingerprint (empty
        with prefix tracking off; a large prompt is hashed off the event loop). `headers` are
        read by their lower-case names: a case-insensitive mapping (serve's) or one keyed in
        lower case (the picker's). `peer`: the address the request came from, when the
        transport knows it (`client_of`)."""
        try:
            body = parse_small_body(raw, endpoint)  # without a coroutine
            if body is None:
                body = await parse_body(raw, endpoint)
            sequences = check_sequences(body, endpoint, self.max_n, self.max_prompts_per_request)
            info = request_info(
                body, endpoint, headers, self.allow_client_override, self.features_wanted(),
                sequences=sequences, client=client_of(headers, peer),
            )  # fmt: skip
        except SpecrouteError as e:
            self._rejected(e)
            raise
        blocks = await prompt_blocks(body, endpoint, len(raw)) if self.prefix_tracking else ()
        return Described(body, info, blocks)

    async def admit(self, info: RequestInfo) -> None:
        """Return once the request may be routed (at once unless every backend it may use is
        full for its sequences); `Overloaded` (429) when it may not, `BadRequest` (400) when it
        never could (more sequences than any of those backends takes at once)."""
        capacity = self.capacity
        if capacity.blocked(info.forced_pool, now := self.clock(), info.sequences):
            try:
                await capacity.admit(info.forced_pool, now, info.sequences)
            except SpecrouteError as e:
                self._rejected(e)
                raise

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

    def issue(self, info: RequestInfo, blocks: tuple[int, ...], arrived_at: float) -> Ticket:
        """View, decide and reserve in one synchronous step (see the module's note)."""
        policy = self.policy
        now = self.clock()
        view = self.tracker.view(now, blocks, info.prompt_tokens, info.sequences)
        try:
            chosen = self.decide(policy, info, view, now)
        except SpecrouteError as e:
            self._rejected(e)
            raise
        n = info.sequences
        reservation = self.capacity.reserve(chosen.backend, (info.max_tokens or 0) * n, blocks, n)
        self.metrics.decision(policy.name, chosen.pool, chosen.reason)
        shadow = () if self.shadows is None else self.shadows.decide(info, view, now, chosen)
        return Ticket(self, info, view, policy, chosen, reservation, shadow, arrived_at, now)

    # -- the back half --

    def _cache_report(self, backend: str, result: Result) -> int | None:
        """The backend's `cached_tokens`. SGLang writes `prompt_tokens_details: null` both when
        it reports no cache and when nothing was cached: after a backend has reported a number
        once, a null from it (in an answer with usage) means 0."""
        cached = result.cached_tokens
        if cached is not None:
            self.cache_reporters.add(backend)
        elif result.prompt_tokens is not None and backend in self.cache_reporters:
            cached = 0
        return as_count(cached)

    def _observe(self, ticket: Ticket, result: Result, outcome: Outcome) -> None:
        policy = ticket.policy
        try:
            policy.observe(outcome)
        except Exception:
            log.exception("policy %r failed in observe()", policy.name)
        if self.shadows is not None:
            self.shadows.observe(outcome)
        metrics = self.metrics
        decision = ticket.decision
        metrics.request_done(decision.pool, decision.backend, result.status)
        metrics.outcome(policy.name, outcome)
        if outcome.cached_tokens is not None and result.status == "ok":
            predicted = believed_cached_on(ticket.view, decision)
            metrics.prefix_outcome(
                decision.pool, decision.backend, predicted, outcome.cached_tokens, result.prompt_tokens
            )
        if result.sent_at is not None:
            metrics.proxy_overhead(max(0.0, result.sent_at - ticket.arrived_at))
        if self.observers:
            record = RequestRecord(
                ticket.info, ticket.view, decision, ticket.chosen, outcome, result.http_status, policy,
                ticket.shadow, ticket.arrived_at,
            )  # fmt: skip
            for observer in self.observers:
                try:
                    observer(record)
                except Exception:
                    log.exception("request observer failed")


class Ticket:
    """One routed request from its decision to its `Outcome`: the decision (`decision`, moved by
    a failover; `chosen`, the first), the view it was made on, the policy that made it, the
    reservation, the shadow policies' choices and the times. See the module's note."""

    __slots__ = (
        "_held",
        "arrived_at",
        "chosen",
        "decision",
        "info",
        "outcome",
        "policy",
        "reservation",
        "shadow",
        "started_at",
        "tickets",
        "view",
    )

    def __init__(
        self,
        tickets: Tickets,
        info: RequestInfo,
        view: LoadView,
        policy: Policy,
        chosen: Decision,
        reservation: Reservation,
        shadow: tuple[ShadowChoice, ...],
        arrived_at: float,
        started_at: float,
    ) -> None:
        self.tickets = tickets
        self.info = info
        self.view = view
        self.policy = policy
        self.chosen = chosen
        self.decision = chosen
        self.reservation = reservation
        self.shadow = shadow
        self.arrived_at = arrived_at
        self.started_at = started_at
        """The decision's `now` (`Outcome.started_at`)."""
        self.outcome: Outcome | None = None
        self._held: list[Charge] = []

    @property
    def backend(self) -> BackendState:
        """The backend the ticket holds a slot on (its `url`, `name`, `pool`)."""
        return self.reservation.backend

    def hold(self, charge: Charge) -> None:
        """Release `charge` (memory the request holds) when the ticket finishes."""
        self._held.append(charge)

    def failover_target(self, tried: Collection[str]) -> BackendState | None:
        """Where the request may go after its backend failed (`policies.routing` rule 5), None
        when nowhere: a backend not in `tried`, of the forced pool if the client forced one."""
        tickets = self.tickets
        forced = self.info.forced_pool is not None
        alt = tickets.router.failover(tickets.tracker.view(tickets.clock()), self.backend.name, tried, forced)
        return None if alt is None else tickets.tracker.get(alt.name)

    def move(self, backend: BackendState) -> None:
        """Re-target the request to `backend` (a failover), its slot moved in one step."""
        tickets = self.tickets
        tickets.metrics.failover(self.backend.pool)
        self.reservation = tickets.capacity.move(self.reservation, backend.name)
        self.decision = replace(self.decision, pool=backend.pool, backend=backend.name, reason="failover")

    def tried_every_usable(self, tried: Collection[str]) -> bool:
        """Whether every backend usable now is in `tried` (none left: "no healthy backend")."""
        tickets = self.tickets
        return all(b.name in tried for b in tickets.tracker.usable(tickets.clock()))

    def finish(self, result: Result) -> Outcome:
        """End the request (see the module's note, step 7); once, later calls return the first
        `Outcome`. Never raises for an observer's failure: the slot is free by then."""
        if self.outcome is not None:
            return self.outcome
        tickets = self.tickets
        tickets.capacity.release(self.reservation)
        for charge in self._held:
            charge.release()
        started = self.started_at
        first = result.first_byte_at
        outcome = self.outcome = Outcome(
            request=self.info,
            decision=self.decision,
            started_at=started,
            ttft_s=None if first is None else max(0.0, first - started),
            completion_tokens=as_count(result.completion_tokens),
            duration_s=max(0.0, result.ended_at - started),
            status=result.status,
            accept_length=result.accept_length,
            cached_tokens=tickets._cache_report(self.backend.name, result),
            failed_over=self.decision.backend != self.chosen.backend,
            client_blocked_s=result.client_blocked_s,
        )
        try:
            tickets._observe(self, result, outcome)
        except Exception:  # a request's end must never fail (its slot is released already)
            log.exception("recording the outcome of a request failed")
        return outcome
