"""Capacity: the in-flight slots of every backend and pool, and the requests waiting for one.

One object owns every capacity decision of the live path: `reserve` takes a slot in the step
that routes a request, `move` re-targets it for a failover (the old pool's waiters are woken),
`release` frees it (once, from a `finally`) and wakes the oldest waiter that may use it,
`back_off` keeps a backend that answered "queue full" out of routing for `backoff_s` (overload
is capacity, not failure: the outlier detector never sees it), and `admit` is the bounded wait.
The counts themselves live on `BackendState` (`controller.proxy.load`), which the load view reads.

Admission: each backend has an in-flight bound (by default its pool's `max_running_requests`
from the profile, or the cap the backend reports, plus `admission_margin`, split over the
`replicas` specroute replicas in front of it: `replica_bound`), and so has each pool (by default
the sum), counted in sequences: a request takes as many slots as the backend runs sequences for
it (`n` x prompts), and has room only where all of them fit. A full backend is `full` in the
`LoadView` (it does not admit: `BackendLoad.admits`), so policies route around it to backends
that still have room, in the same pool or the other. Only when none of the backends a
request may use has room (all of them, or those of the pool the client forced) does the request
wait here, in arrival order, before anything is decided. Each released slot wakes the oldest
waiter that may use its pool; the waiter then asks the policy with the load as it is at that
moment (and waits on if another request took the slot first); a waiter of several sequences is
woken only once they fit, so it does not hold up the smaller ones behind it. Past `wait_s` -- or
at once when `max_waiting` requests wait already -- it gets 429 with `Retry-After` in OpenAI's
error shape. A request of more sequences than any backend it may use takes at once (or than its
pool's bound) could never be admitted: it gets 400 at once instead of waiting.
Nothing waits on a backend that is down: a request whose backends are all unusable goes on to
the routing decision (panic mode or 503), not into this queue.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.proxy.config import Settings
from controller.proxy.errors import BadRequest, Overloaded
from controller.proxy.load import BackendState, LoadTracker, Reservation
from controller.proxy.watchdog import poll_s
from policies.base import POOLS, Pool
from policies.profile import Profile

WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RECHECK_S = 1.0
"""A waiter also looks again this often (a backend may come back without any slot freeing)."""
RETRY_AFTER_S = 1


@dataclass(eq=False, slots=True)
class _Waiter:
    forced: Pool | None
    sequences: int
    pools: frozenset[Pool]
    wake: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.waits = Counter(
            "specroute_admission_waits",
            "Requests that waited in specroute because every backend they may use was at its bound.",
            registry=registry,
        )
        self.rejections = Counter(
            "specroute_admission_rejections",
            "Requests answered 429 after waiting admission_wait_s, or at once with admission_max_waiting "
            "requests waiting.",
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "specroute_admission_wait_seconds",
            "Time requests waited for a free slot (requests that waited), by how the wait ended.",
            ["outcome"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.waiting = Gauge(
            "specroute_admission_waiting_requests", "Requests waiting for a free slot now.", registry=registry
        )


class Capacity:
    def __init__(
        self,
        tracker: LoadTracker,
        metrics: AdmissionMetrics,
        *,
        wait_s: float,
        max_waiting: int,
        clock: Callable[[], float],
        backoff_s: float = 1.0,
    ) -> None:
        self.tracker = tracker
        self.backoff_s = backoff_s
        self.clock = clock
        self.metrics = metrics
        self.wait_s = wait_s
        self.max_waiting = max_waiting
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def blocked(self, forced: Pool | None, now: float, sequences: int = 1) -> bool:
        """Whether a request (forced to a pool, or not) of `sequences` must wait: some backend it
        may use is usable, and none of them has room for all its sequences."""
        tracker = self.tracker
        usable = tracker.usable(now)
        if forced is not None:
            usable = [b for b in usable if b.pool == forced]
        if not usable:
            return False
        room = {p: tracker.pool_has_room(p, sequences) for p in POOLS}
        for b in usable:  # (a loop, not any() over a generator: on every request's path)
            if room[b.pool] and b.has_room(now, sequences):
                return False
        return True

    def check_fits(self, forced: Pool | None, sequences: int) -> None:
        """BadRequest when no backend the request may use could ever take its `sequences` at
        once: each is bounded below them, or its pool is."""
        most = 0
        tracker = self.tracker
        for b in tracker:
            if forced is not None and b.pool != forced:
                continue
            bounds = [x for x in (b.max_in_flight, tracker.pool_max_in_flight[b.pool]) if x is not None]
            fits = min(bounds, default=sequences)
            if fits >= sequences:
                return
            most = max(most, fits)
        raise BadRequest(
            f"this request runs {sequences} sequences (n x prompts) and the backends it may use run at "
            f"most {most} at once for specroute (their in-flight bound): send fewer per request",
            param="n",
        )

    async def admit(self, forced: Pool | None, now: float, sequences: int = 1) -> float:
        """Return once the request may be routed (at once in the usual case, without suspending);
        the seconds it waited. Raises `Overloaded` when it may not, `BadRequest` when it never
        could (`check_fits`)."""
        if not self.blocked(forced, now, sequences):
            return 0.0
        if sequences > 1:
            self.check_fits(forced, sequences)
        if len(self._waiters) >= self.max_waiting or self.wait_s <= 0:
            self.metrics.rejections.inc()
            raise Overloaded(
                f"all backends are at their in-flight bound and {len(self._waiters)} request(s) wait already",
                retry_after_s=RETRY_AFTER_S,
            )
        loop = asyncio.get_running_loop()
        started = self.clock()
        deadline = started + self.wait_s
        poll = poll_s(self.clock)  # a clock whose time may jump (a test's) is read this often
        waiter = _Waiter(forced, sequences, frozenset(POOLS if forced is None else (forced,)))
        self._waiters.append(waiter)
        self.metrics.waits.inc()
        self.metrics.waiting.inc()
        outcome = "client_closed"
        try:
            while True:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    outcome = "rejected"
                    self.metrics.rejections.inc()
                    raise Overloaded(
                        f"all backends are at their in-flight bound; waited {self.wait_s:g} s for a slot",
                        retry_after_s=RETRY_AFTER_S,
                    )
                try:
                    async with asyncio.timeout(min(remaining, RECHECK_S, poll)):
                        await waiter.wake
                except TimeoutError:
                    pass
                if not self.blocked(forced, self.clock(), sequences):
                    outcome = "admitted"
                    return self.clock() - started
                if waiter.wake.done():
                    waiter.wake = loop.create_future()  # another request took the slot: wait on, in place
        finally:
            self._waiters.remove(waiter)
            self.metrics.waiting.dec()
            self.metrics.wait_seconds.labels(outcome).observe(max(0.0, self.clock() - started))

    def reserve(
        self, name: str, tokens: int = 0, blocks: tuple[int, ...] = (), sequences: int = 1
    ) -> Reservation:
        """`sequences` slots on backend `name` (call in the step that decided it: no await in
        between)."""
        return self.tracker.reserve(name, tokens, blocks, sequences)

    def release(self, reservation: Reservation) -> None:
        """Free the slot (at most once) and let a request waiting for one have it."""
        if reservation.released:
            return
        self.tracker.release(reservation)
        self.released(reservation.backend.pool)

    def move(self, reservation: Reservation, name: str) -> Reservation:
        """The same request's slot moved to backend `name` (a failover), in one step."""
        moved = self.tracker.move(reservation, name)
        self.released(reservation.backend.pool)
        return moved

    def back_off(self, backend: BackendState, now: float) -> None:
        """`backend` said its queue is full: no new request goes to it for `backoff_s`."""
        if self.backoff_s > 0:
            backend.backoff_until = now + self.backoff_s

    def released(self, pool: Pool) -> None:
        """A slot of `pool` freed: wake the oldest waiter that may use it and, if it runs several
        sequences, now has room for them."""
        now: float | None = None
        for waiter in self._waiters:
            if pool in waiter.pools and not waiter.wake.done():
                if waiter.sequences > 1:
                    now = self.clock() if now is None else now
                    if self.blocked(waiter.forced, now, waiter.sequences):
                        continue
                waiter.wake.set_result(None)
                return


def replica_bound(cap: int, margin: float, replicas: int = 1) -> int:
    """This replica's admission bound on a backend that runs `cap` requests at most: the cap plus
    `margin`, divided evenly between the `replicas` specroute replicas that share the backend (at
    least 1). Bounds set explicitly (`*_max_in_flight`) are per replica as given."""
    return max(1, math.ceil(cap * (1 + margin) / replicas))


def in_flight_bounds(
    settings: Settings, profile: Profile | None
) -> tuple[dict[str, int | None], dict[Pool, int | None]]:
    """(bound per backend name, bound per pool) from the settings; None is unbounded. A backend's
    default is `replica_bound` of its pool's `max_running_requests` in the profile."""
    backends: dict[str, int | None] = {}
    pools: dict[Pool, int | None] = {}
    for pool in POOLS:
        explicit: int | None = getattr(settings, f"{pool}_backend_max_in_flight")
        bound: int | None
        if explicit is not None:
            bound = explicit or None
        else:
            mode = profile.modes.get(pool) if profile is not None else None
            cap = mode.max_running_requests if mode is not None else None
            bound = replica_bound(cap, settings.admission_margin, settings.replicas) if cap else None
        for b in settings.backends(pool):
            backends[b.name] = bound
        pool_bound: int | None = getattr(settings, f"{pool}_max_in_flight")
        pools[pool] = pool_bound or None
    return backends, pools
