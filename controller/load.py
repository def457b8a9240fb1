"""Per-backend load state and exact in-flight accounting.

How it works: every request holds exactly one `Reservation` at a time. `reserve` is called in
the same synchronous step as `policy.choose` (no `await` in between, so no other request can
observe a stale count), and `release` is called from a `finally` on every path. A reservation
releases at most once, so a double release cannot drive a count negative; `move` re-targets a
reservation for a failover in one synchronous step.

The scraped fields (`running`, `queued`, `accept_length`, `sample_time`) are slots that the
backend scraper fills; `view` only reports them while they are fresher than `stale_after_s`.
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
    queued: int | None = None
    accept_length: float | None = None
    sample_time: float | None = None

    def load(self, now: float, stale_after_s: float) -> BackendLoad:
        fresh = self.sample_time is not None and now - self.sample_time <= stale_after_s
        return BackendLoad(
            name=self.name,
            pool=self.pool,
            healthy=self.healthy,
            in_flight=self.in_flight,
            in_flight_tokens=self.in_flight_tokens,
            running=self.running if fresh else None,
            queued=self.queued if fresh else None,
            accept_length=self.accept_length if fresh else None,
            sample_age_s=(now - self.sample_time) if fresh and self.sample_time is not None else None,
        )


@dataclass(slots=True)
class Reservation:
    backend: BackendState
    tokens: int
    released: bool = False


class LoadTracker:
    """The backends of both pools with their health and proxy-local load."""

    def __init__(self, baseline: Iterable[str], eagle: Iterable[str], *, stale_after_s: float = 10.0) -> None:
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
