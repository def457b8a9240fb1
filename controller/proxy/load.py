"""Per-backend load state and exact in-flight accounting.

How it works: every request holds exactly one `Reservation` at a time, of as many slots as the
backend runs sequences for it (`n` x prompts: SGLang and vLLM run each as a request of their
own), so in-flight counts are in sequences, as the backends count theirs. `reserve` is called in
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

The view is built by `policies.view` (the builder every simulated router uses too); this module
supplies the facts. Availability: a backend is *usable* (`BackendLoad.usable`) when its health
probes pass (`healthy`) and the outlier detector has not ejected it (`ejected_until`); when no
backend of either pool is usable and `panic` is on, all of them are (Envoy's panic mode: try
them rather than refuse). A usable backend takes a request only while it and its pool are below
their in-flight bounds (`max_in_flight`, `pool_max_in_flight`; None = unbounded): a full one is
`full` in the view (it does not admit), so policies route around it, and when every backend a
request may use is full the request waits in `controller.proxy.capacity`.

Prefixes (`controller.proxy.prefixes`): each backend may carry a `PrefixIndex` of the prompt
blocks it was sent. `view(now, blocks)` reports each backend's matched prefix of the request's
`blocks` as `BackendLoad.cached_tokens`; `reserve(name, tokens, blocks)` records them on the
chosen backend and `move` on the failover target (the one that actually gets the prompt), each
in the step that takes the slot. An index only learns by insertion, so a backend that failed
keeps the blocks until they age out; it is marked unhealthy or counted by the outlier detector
anyway, and its real cache reports what it holds (`specroute_prefix_false_hits_total`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from controller.proxy.config import BackendSpec
from controller.proxy.engines import taken
from policies.base import POOLS, LoadView, Pool
from policies.prefix import DEFAULT_BLOCK_TOKENS, PrefixIndex
from policies.view import STALE_AFTER_S, LastLoads, backend_load, believed_cached, dispatched, load_view


@dataclass(slots=True)
class BackendState:
    name: str
    """The backend's configured name (its URL unless named): in decisions, headers, metric labels."""
    pool: Pool
    url: str = ""
    """The base URL requests, probes and scrapes go to (never shown to clients unless it is the name)."""
    healthy: bool = True
    """What the active health probes say (see `controller.proxy.health`)."""
    ejected_until: float | None = None
    """Set by the outlier detector: no requests until then (the proxy's clock)."""
    max_in_flight: int | None = None
    """Admission bound of this backend, in sequences; None: unbounded."""
    max_running: int | None = None
    """The running-request cap the backend reports (None: not reported); in the view for policies."""
    backoff_until: float | None = None
    """Set by `controller.proxy.capacity` after a "queue full": takes no requests until then."""
    in_flight: int = 0
    """Sequences in flight (a request counts its `RequestInfo.sequences`)."""
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
    prefixes: PrefixIndex | None = None
    """The prompt blocks this backend was recently sent (None: prefix tracking off)."""

    def ejected(self, now: float) -> bool:
        until = self.ejected_until
        return until is not None and now < until

    def has_room(self, now: float | None = None, sequences: int = 1) -> bool:
        """Room for `sequences` more within its bound (and, given `now`, not backing off a
        "queue full")."""
        if now is not None and self.backoff_until is not None and now < self.backoff_until:
            return False
        bound = self.max_in_flight
        return bound is None or self.in_flight + sequences <= bound


@dataclass(slots=True)
class Reservation:
    backend: BackendState
    tokens: int
    released: bool = False
    blocks: tuple[int, ...] = ()
    """The request's prompt fingerprint (recorded on the backend that holds the reservation)."""
    sequences: int = 1
    """Slots held: the sequences the backend runs for the request."""


class LoadTracker:
    """The backends of both pools with their health and proxy-local load."""

    def __init__(
        self,
        baseline: Iterable[BackendSpec],
        eagle: Iterable[BackendSpec],
        *,
        stale_after_s: float = STALE_AFTER_S,
        panic: bool = True,
        replicas: float = 1.0,
    ) -> None:
        """`baseline`, `eagle`: the backends of each pool, as parsed by `Settings`
        (`config.parse_backend`)."""
        self.backends: dict[str, BackendState] = {}
        pools: tuple[tuple[Pool, Iterable[BackendSpec]], ...] = (
            ("baseline", baseline),
            ("eagle", eagle),
        )
        for pool, entries in pools:
            for spec in entries:
                if spec.pool != pool:
                    raise ValueError(f"backend {spec.name} of pool {spec.pool} given as a {pool} backend")
                if spec.name in self.backends:
                    raise ValueError(f"backend {spec.name} listed twice")
                self.backends[spec.name] = BackendState(name=spec.name, pool=pool, url=spec.url)
        self.stale_after_s = stale_after_s
        self.panic = panic
        self.replicas = replicas
        """The `replicas` setting: this replica's traffic since a sample counts this many times
        (`policies.replicas.believed_counts`)."""
        self.pool_max_in_flight: dict[Pool, int | None] = {"baseline": None, "eagle": None}
        self._loads = LastLoads()

    def __iter__(self) -> Iterator[BackendState]:
        return iter(self.backends.values())

    def get(self, name: str) -> BackendState:
        return self.backends[name]

    def pool_backends(self, pool: Pool) -> list[BackendState]:
        return [b for b in self.backends.values() if b.pool == pool]

    def set_bounds(self, backend: Mapping[str, int | None], pool: Mapping[Pool, int | None]) -> None:
        """Admission bounds: per backend name and per pool (None: unbounded)."""
        for name, bound in backend.items():
            self.backends[name].max_in_flight = bound
        self.pool_max_in_flight = {p: pool.get(p) for p in POOLS}

    def ready(self, now: float) -> list[BackendState]:
        """Backends in service: their probes pass and the outlier detector has not ejected them
        (what `/ready` counts)."""
        return [b for b in self.backends.values() if b.healthy and not b.ejected(now)]

    def usable(self, now: float) -> list[BackendState]:
        """Backends that may get requests health-wise: the `ready` ones; in panic (none ready,
        `panic` on) every backend."""
        up = self.ready(now)
        if not up and self.panic:
            return list(self.backends.values())
        return up

    def pool_has_room(self, pool: Pool, sequences: int = 1) -> bool:
        """Room for `sequences` more within `pool`'s bound."""
        bound = self.pool_max_in_flight[pool]
        if bound is None:
            return True
        return sum(b.in_flight for b in self.backends.values() if b.pool == pool) + sequences <= bound

    def track_prefixes(self, capacity_tokens: Mapping[str, int]) -> None:
        """Give each named backend a prefix index holding `capacity_tokens` tokens (in blocks)."""
        for name, tokens in capacity_tokens.items():
            self.backends[name].prefixes = PrefixIndex(tokens // DEFAULT_BLOCK_TOKENS)

    def view(
        self, now: float, blocks: tuple[int, ...] = (), prompt_tokens: int | None = None, sequences: int = 1
    ) -> LoadView:
        """Every backend's load (`policies.view`): `usable` as `usable` says, `full` = no room
        within its own or its pool's bound for the request's `sequences` (`admits`: may take this
        request now); `cached_tokens`: the matched prefix
        of the request's prompt `blocks` on each backend, at most `prompt_tokens` (the request's
        estimate: blocks of canonical text also hold the chat roles, which the estimate does
        not count)."""
        stale, replicas = self.stale_after_s, self.replicas
        usable = {b.name for b in self.usable(now)}
        room = {p: self.pool_has_room(p, sequences) for p in POOLS}
        reuse = self._loads
        return load_view(
            [
                backend_load(
                    b.name, b.pool, b.in_flight, b.in_flight_tokens,
                    usable=b.name in usable, full=not (room[b.pool] and b.has_room(now, sequences)),
                    cached_tokens=believed_cached(b.prefixes, blocks, prompt_tokens),
                    running=b.running, queued=b.queued, sample_time=b.sample_time,
                    sample_in_flight=b.sample_in_flight, accept_length=b.accept_length, now=now,
                    stale_after_s=stale, replicas=replicas, max_running=b.max_running, reuse=reuse,
                )
                for b in self.backends.values()
            ]
        )  # fmt: skip

    def reserve(
        self, name: str, tokens: int = 0, blocks: tuple[int, ...] = (), sequences: int = 1
    ) -> Reservation:
        """Take `sequences` slots on `name` for a request of at most `tokens` output tokens (all
        its sequences together) whose prompt fingerprint is `blocks` (recorded in the backend's
        prefix index: from now on it is believed cached there)."""
        b = self.backends[name]
        b.in_flight += sequences
        b.in_flight_tokens += tokens
        dispatched(b.prefixes, blocks)
        return Reservation(b, tokens, blocks=blocks, sequences=sequences)

    def release(self, r: Reservation) -> None:
        if r.released:
            return
        r.released = True
        r.backend.in_flight -= r.sequences
        r.backend.in_flight_tokens -= r.tokens

    def move(self, r: Reservation, name: str) -> Reservation:
        """Release `r` and reserve `name` for the same request, in one synchronous step."""
        self.release(r)
        return self.reserve(name, r.tokens, r.blocks, r.sequences)

    def record_sample(
        self,
        name: str,
        running: float,
        queued: float,
        taken_at: float,
        in_flight_at_sample: int | None,
        accept_length: float | None = None,
        gen_throughput: float | None = None,
    ) -> bool:
        """Store a scraped sample taken at `taken_at` (when this replica had
        `in_flight_at_sample` requests in flight on the backend); False (nothing stored) when its
        running or queued count is out of range (`engines.RANGES`). An accept length or throughput
        out of range is stored as unknown."""
        if taken("running", running) is None or taken("queued", queued) is None:
            return False
        b = self.backends[name]
        b.running = round(running)
        b.queued = round(queued)
        b.accept_length = taken("accept_length", accept_length)
        b.gen_throughput = taken("gen_throughput", gen_throughput)
        b.sample_time = taken_at
        b.sample_in_flight = in_flight_at_sample
        return True

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
