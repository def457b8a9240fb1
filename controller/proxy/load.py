"""Per-backend load state and exact in-flight accounting.

How it works: every request holds exactly one `Reservation` at a time. `reserve` is called in
the same synchronous step as `policy.choose` (no `await` in between, so no other request can
observe a stale count), and `release` is called from a `finally` on every path. A reservation
releases at most once, so a double release cannot drive a count negative; `move` re-targets a
reservation for a failover in one synchronous step.

Scraped samples (`record_sample`, filled by `controller.proxy.scrape.ScrapeLoop`) are combined with
this replica's own traffic: a sample carries the backend's running/queued counts and this
replica's in-flight count when the scrape was sent, so the requests dispatched (+1) and finished
(-1) since then are exactly `in_flight - sample_in_flight`. `view` reports running + queued
corrected by that difference (the backend's count already includes the other replicas'
requests), and drops samples older than `stale_after_s`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from policies.base import BackendLoad, LoadView, Pool, PoolLoad


@dataclass(slots=True)
class BackendState:
    name: str
    """The backend's base URL; also its name in decisions, headers and metric labels."""
    pool: Pool
    healthy: bool = True
    in_flight: int = 0
    in_flight_tokens: int = 0
    running: int | None = None
    """Backend-reported running requests of the latest sample (as reported, uncorrected)."""
    queued: int | None = None
    accept_length: float | None = None
    gen_throughput: float | None = None
    sample_time: float | None = None
    """When the latest sample was taken (sent), on the proxy's clock; None before the first."""
    sample_in_flight: int | None = None
    """`in_flight` when the latest sample was taken; None: the sample already counts ours."""

    def load(self, now: float, stale_after_s: float) -> BackendLoad:
        t = self.sample_time
        if t is None or now - t > stale_after_s or self.running is None:
            return BackendLoad(
                name=self.name,
                pool=self.pool,
                healthy=self.healthy,
                in_flight=self.in_flight,
                in_flight_tokens=self.in_flight_tokens,
            )
        running, queued = self.running, self.queued or 0
        if self.sample_in_flight is not None:
            running, queued = corrected(running, queued, self.in_flight - self.sample_in_flight)
        return BackendLoad(
            name=self.name,
            pool=self.pool,
            healthy=self.healthy,
            in_flight=self.in_flight,
            in_flight_tokens=self.in_flight_tokens,
            running=running,
            queued=queued,
            accept_length=self.accept_length,
            sample_age_s=now - t,
        )


def corrected(running: int, queued: int, delta: int) -> tuple[int, int]:
    """Running/queued after `delta` requests joined (+) or left (-) since the sample.

    New requests count as running (the backend's capacity is not known here); leaving ones
    shrink the total, and the queue never exceeds the total.
    """
    total = max(0, running + queued + delta)
    queued = min(queued, total)
    return total - queued, queued


@dataclass(slots=True)
class Reservation:
    backend: BackendState
    tokens: int
    released: bool = False


class LoadTracker:
    """The backends of both pools with their health and proxy-local load."""

    def __init__(self, baseline: Iterable[str], eagle: Iterable[str], *, stale_after_s: float = 5.0) -> None:
        self.backends: dict[str, BackendState] = {}
        for pool, urls in (("baseline", baseline), ("eagle", eagle)):
            for url in urls:
                if url in self.backends:
                    raise ValueError(f"backend {url} listed twice")
                self.backends[url] = BackendState(name=url, pool=pool)  # type: ignore[arg-type]
        self.stale_after_s = stale_after_s

    def __iter__(self) -> Iterator[BackendState]:
        return iter(self.backends.values())

    def get(self, name: str) -> BackendState:
        return self.backends[name]

    def pool_backends(self, pool: Pool) -> list[BackendState]:
        return [b for b in self.backends.values() if b.pool == pool]

    def view(self, now: float) -> LoadView:
        base: list[BackendLoad] = []
        eagle: list[BackendLoad] = []
        stale = self.stale_after_s
        for b in self.backends.values():
            (base if b.pool == "baseline" else eagle).append(b.load(now, stale))
        return LoadView(baseline=PoolLoad("baseline", tuple(base)), eagle=PoolLoad("eagle", tuple(eagle)))

    def reserve(self, name: str, tokens: int = 0) -> Reservation:
        b = self.backends[name]
        b.in_flight += 1
        b.in_flight_tokens += tokens
        return Reservation(b, tokens)

    def release(self, r: Reservation) -> None:
        if r.released:
            return
        r.released = True
        r.backend.in_flight -= 1
        r.backend.in_flight_tokens -= r.tokens

    def move(self, r: Reservation, name: str) -> Reservation:
        """Release `r` and reserve `name` for the same request, in one synchronous step."""
        self.release(r)
        return self.reserve(name, r.tokens)

    def record_sample(
        self,
        name: str,
        running: float,
        queued: float,
        taken_at: float,
        in_flight_at_sample: int | None,
        accept_length: float | None = None,
        gen_throughput: float | None = None,
    ) -> None:
        """Store a scraped sample taken at `taken_at` (when this replica had
        `in_flight_at_sample` requests in flight on the backend)."""
        b = self.backends[name]
        b.running = round(running)
        b.queued = round(queued)
        b.accept_length = accept_length
        b.gen_throughput = gen_throughput
        b.sample_time = taken_at
        b.sample_in_flight = in_flight_at_sample

    def set_healthy(self, name: str, healthy: bool) -> bool:
        """Set a backend's health; True when it changed."""
        b = self.backends[name]
        if b.healthy == healthy:
            return False
        b.healthy = healthy
        return True

    @property
    def total_in_flight(self) -> int:
        return sum(b.in_flight for b in self.backends.values())

    def any_healthy(self) -> bool:
        return any(b.healthy for b in self.backends.values())
