"""The completion routes over HTTP: read the body, take the request through the front half
(`controller.proxy.ticket`), and hand its ticket to a `RequestLifecycle`.

How it works:
1. Read the body within the byte, JSON-structure, compression-ratio and memory budgets
   (`limits.py`, `memory.py`; bad input -> 400/413, no memory -> 503).
2. The front half (`ticket.Tickets`): parse it once, build the `RequestInfo` and fingerprint
   the prompt (`describe`), wait if every backend it may use is full (`capacity.py`), then view, decide and
   reserve in one synchronous step: a `Ticket`.
3. The lifecycle (`lifecycle.py`) opens the upstream request (`upstream.py`), fails over once
   where that is safe, relays the answer, and ends the request on every path (client
   disconnect = handler cancellation included): the ticket's `finish` releases what it holds and
   feeds the `Outcome` to the policy that chose the request, the shadow policies, the metrics and
   the observers (decision log). The forwarder reads nothing back.

Every attempt's fate goes to the outlier detector, as `upstream.py`'s table says: what a client
can cause (4xx, queue full, a long generation) is never held against a backend.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from controller.proxy.config import Settings
from controller.proxy.core import Core
from controller.proxy.errors import SpecrouteError
from controller.proxy.headers import upstream_headers
from controller.proxy.lifecycle import Relay, RelayLimits, RequestLifecycle
from controller.proxy.limits import BodyGate, JsonBudget, read_body
from controller.proxy.memory import Charge
from policies.base import EndpointKind, Policy, Pool

log = logging.getLogger("specroute.forward")


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """The settings a request body is read within."""

    limit_bytes: int
    max_json_values: int
    max_json_containers: int
    timeout_s: float
    max_compression_ratio: float
    wait_s: float
    """How long a large body may wait for room in the memory budget (`admission_wait_s`)."""
    read_concurrency: int
    log_bodies: bool

    @classmethod
    def from_settings(cls, s: Settings) -> BodyLimits:
        return cls(
            s.body_limit_bytes, s.body_max_json_values, s.body_max_json_containers, s.body_timeout_s,
            s.body_max_compression_ratio, s.admission_wait_s, s.body_read_concurrency, s.log_bodies,
        )  # fmt: skip


class Forwarder:
    """Serves the completion routes. `policy` may be swapped at any time (hot reload): each
    request keeps the policy object that chose it."""

    def __init__(self, core: Core) -> None:
        settings = core.settings
        self.settings = settings
        self.tracker = core.tracker
        self.metrics = core.metrics
        self.clock = clock = core.clock
        self.capacity = core.capacity
        self.tickets = core.tickets
        self.relay = Relay(
            RelayLimits.from_settings(settings),
            clock=clock,
            budget=core.budget,
            identity=core.identity,
            reports=core.reports,
            rewrite=core.rewrite,
            client_stalls=core.metrics.client_stalls,
        )
        self.budget = core.budget
        self.identity = core.identity
        """What clients may learn of the backends: every client-bound message passes it."""
        self.relays = self.relay.relays
        self.observers = self.tickets.observers
        self.shadows = self.tickets.shadows
        self.body_limits = limits = BodyLimits.from_settings(settings)
        self.body_gate = BodyGate(limits.read_concurrency, limits.wait_s, clock)
        self.active: set[asyncio.Task[Any]] = set()
        """The handler tasks of requests in progress (a shutdown cancels those left after draining)."""

    @property
    def policy(self) -> Policy:
        return self.tickets.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.tickets.policy = policy

    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self.relay.session

    @session.setter
    def session(self, session: aiohttp.ClientSession | None) -> None:
        self.relay.session = session

    def auth_header(self, pool: Pool) -> str | None:
        """The Authorization header configured for `pool` (None: forward the client's)."""
        return self.relay.rewrite.auth_header(pool)

    async def read_body(self, request: web.Request, charge: Charge | None = None) -> bytes:
        """The request body within `body_limit_bytes`, the JSON budget, the compression ratio,
        the memory budget (`charge`; a large body waits up to `admission_wait_s` for room) and
        `body_timeout_s`; a costly one in its turn at the `BodyGate` (`body_read_concurrency`)."""
        b = self.body_limits
        budget = JsonBudget(b.max_json_values, b.max_json_containers)
        async with self.body_gate.turn(request):
            return await read_body(
                request, limit=b.limit_bytes, budget=budget, timeout_s=b.timeout_s, charge=charge,
                max_ratio=b.max_compression_ratio, wait_s=b.wait_s, clock=self.clock,
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

    async def _handle(
        self, request: web.Request, endpoint: EndpointKind, path: str, charge: Charge
    ) -> web.StreamResponse:
        arrived = self.clock()
        tickets = self.tickets
        try:
            raw = await self.read_body(request, charge)
        except SpecrouteError as e:
            self.metrics.reject(e.status)
            raise
        request_ = await tickets.describe(raw, endpoint, request.headers, request.remote)
        try:
            headers = upstream_headers(request.headers)
        except SpecrouteError as e:
            self.metrics.reject(e.status)
            raise
        if self.body_limits.log_bodies:
            log.info("request %s %s", path, raw[:65536].decode(errors="replace"))
        info = request_.info
        await tickets.admit(info)
        ticket = tickets.issue(info, request_.blocks, arrived)
        lifecycle = RequestLifecycle(self.relay, ticket, request, request_.body, raw, path, headers, charge)
        return await lifecycle.run()
