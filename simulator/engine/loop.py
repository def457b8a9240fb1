"""The discrete-event engine: requests through simulated servers, routed by a policy.

`simulate` wires the engine's objects together and runs their events:

- `simulator.engine.events`: the typed event queue, `(time, seq)` ordered;
- `simulator.engine.server.Server`: one server's admission, prefill (with its true prefix cache,
  `simulator.engine.cache`), continuous-batching decode and completions;
- `simulator.engine.dispatch`: the routers (view, decide, dispatch, observe): the least-loaded
  rule without a policy, one router with the perfect view, or several replicas with scraped
  views (`simulator.engine.replica_views`); each builds its `LoadView` with `policies.view` and decides
  with `policies.routing.Router`, the code the proxy runs, and keeps its own
  `policies.prefix.PrefixIndex` per server when the batch carries prompt blocks;
- `simulator.engine.clients`: where requests come from, an open loop of arrival times or a
  closed loop of clients.

Policies see the same `LoadView`/`RequestInfo` types as in the proxy, get `observe(Outcome)` when
a request finishes, and `reset()` (`policies.routing.reset`) when a run (a segment) starts.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from policies.base import Policy, RequestFeatures
from policies.prefix import DEFAULT_BLOCK_TOKENS, PrefixIndex
from policies.routing import reset
from simulator.engine.clients import FILLER, MEASURED, NOT_SENT, WARMUP, ClosedLoop, OpenLoop
from simulator.engine.colocation import link, server_types
from simulator.engine.deployment import ServerModel
from simulator.engine.dispatch import Dispatcher, LeastLoaded, OneRouter, Replicas, Requests
from simulator.engine.errors import SimulationError
from simulator.engine.events import EventQueue
from simulator.engine.replica_views import RouterGroup, Routers
from simulator.engine.server import Prompts, Server

__all__ = [
    "FILLER",
    "MEASURED",
    "NOT_SENT",
    "WARMUP",
    "RawRun",
    "RequestBatch",
    "SimulationError",
    "simulate",
]


@dataclass(frozen=True)
class RequestBatch:
    """Requests to simulate, column-wise. `arrivals` is None for a closed loop."""

    prompt_tokens: Sequence[int]
    output_tokens: Sequence[int]
    max_tokens: Sequence[int | None]
    hints: Sequence[str | None]
    accept: Sequence[float]
    """Per-request acceptance factor (mean 1), applied on speculative servers."""
    arrivals: Sequence[float] | None = None
    blocks: Sequence[Sequence[int]] | None = None
    """Per-request prompt block ids (chained: equal leading ids = equal prefix), or None when
    prompts share nothing."""
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    """Tokens per block of `blocks` (the last block of a prompt may be partial)."""
    features: Sequence[RequestFeatures | None] | None = None
    """Per-request content features (`policies.features`), handed to the policy on
    `RequestInfo.features`; None when the workload has no text (synthetic, traces)."""
    hints_seen: bool = True
    """Whether the policy sees `hints` (`RequestInfo.hint`); False: they only set what each
    request is (its `accept`), as when clients do not send `x-specroute-hint`."""

    def __len__(self) -> int:
        return len(self.output_tokens)

    def head(self, n: int) -> RequestBatch:
        """The first `n` requests."""
        arrivals = None if self.arrivals is None else self.arrivals[:n]
        return RequestBatch(
            self.prompt_tokens[:n],
            self.output_tokens[:n],
            self.max_tokens[:n],
            self.hints[:n],
            self.accept[:n],
            arrivals,
            None if self.blocks is None else self.blocks[:n],
            self.block_tokens,
            None if self.features is None else self.features[:n],
            self.hints_seen,
        )


@dataclass(frozen=True)
class RawRun:
    """Per-request times (seconds from the start of the run) and where each request ran."""

    arrival: list[float]
    first_token: list[float]
    finish: list[float]
    server: list[int]
    """Index into `servers`; -1 for a request that was never sent."""
    phase: list[int]
    """WARMUP, MEASURED, FILLER or NOT_SENT (open loop: all MEASURED)."""
    output_tokens: Sequence[int]
    servers: tuple[ServerModel, ...]
    prompt_tokens: Sequence[int] = ()
    cached_tokens: Sequence[int] | None = None
    """Prompt tokens each request found in its server's prefix cache; None: no cache modelled."""


def _check(servers: Sequence[ServerModel], batch: RequestBatch, concurrency: int | None) -> int:
    """Validate a run's inputs; the length of the servers' common speed tables."""
    if not servers:
        raise SimulationError("no servers to simulate")
    if batch.arrivals is None and (concurrency is None or concurrency < 1):
        raise SimulationError("a closed loop needs concurrency >= 1")
    if batch.arrivals is not None and any(
        map(operator.gt, batch.arrivals, itertools.islice(batch.arrivals, 1, None))
    ):
        raise SimulationError("open-loop arrival times must be sorted")
    if batch.block_tokens < 1:
        raise SimulationError("block_tokens must be >= 1")
    table_size = min(len(m.rate) for m in servers)
    if any(len(m.ttft) < table_size for m in servers):
        raise SimulationError("server speed tables must cover the same batch sizes")
    return table_size


def _indexes(
    servers: Sequence[ServerModel], believed: Sequence[int | None] | None, block_tokens: int
) -> list[PrefixIndex]:
    """One router's prefix index per server, sized by what it believes each server holds."""
    capacities = believed or [m.cache_tokens for m in servers]
    if len(capacities) != len(servers):
        raise SimulationError("index_cache_tokens needs one capacity per server")
    return [PrefixIndex((c or 0) // block_tokens) for c in capacities]


def _dispatcher(
    states: Sequence[Server],
    policy: Policy | None,
    routers: RouterGroup | None,
    batch: RequestBatch,
    requests: Requests,
    seed: int,
    index_cache_tokens: Sequence[int | None] | None,
) -> tuple[Dispatcher, Routers | None]:
    """The run's routers (and the replicas' group, which also scrapes). A single-pool deployment
    is routed least-loaded, without a policy; a perfect-view group is one plain router."""
    two_pools = len({s.pool for s in states}) == 2
    group = routers if routers is not None and two_pools else None
    if group is not None and group.setup.perfect:
        policy, group = group.policies[0], None
    blocks, bt = batch.blocks, batch.block_tokens
    models = [s.model for s in states]
    if group is not None:
        for p in group.policies:
            reset(p)
        budget = states[0].budget
        multi = Routers(
            group,
            [(s.name, s.pool, s.accept_length) for s in states],
            lambda: ([s.running for s in states], [len(s.queue) for s in states]),
            seed,
            budget,
        )
        indexes = (
            None if blocks is None else [_indexes(models, index_cache_tokens, bt) for _ in range(multi.n)]
        )
        return Replicas(multi, states, requests, blocks, indexes, bt), multi
    if policy is None or not two_pools:
        return LeastLoaded(states, seed), None
    reset(policy)  # a segment starts: the clock is back at 0
    one = None if blocks is None else _indexes(models, index_cache_tokens, bt)
    return OneRouter(states, policy, seed, requests, blocks, one, bt), None


def simulate(
    servers: Sequence[ServerModel],
    policy: Policy | None,
    batch: RequestBatch,
    *,
    concurrency: int | None = None,
    warmup: int = 0,
    measure: int | None = None,
    seed: int = 0,
    spec_details: bool = False,
    index_cache_tokens: Sequence[int | None] | None = None,
    routers: RouterGroup | None = None,
) -> RawRun:
    """Run `batch` through `servers`.

    Open loop when `batch.arrivals` is given; otherwise a closed loop of `concurrency` clients
    that each send the next request (in batch order) as soon as their previous one finished,
    with `warmup` and `measure` as in `specroute bench` (see `clients.ClosedLoop`); a closed loop
    that runs out of requests in the batch stops sending.
    Every request is routed by the routing core (`policies.routing.Router`, seeded with
    `seed`), exactly as the proxy routes it; with `policy` None (or all servers in one pool)
    it goes to the least-loaded server by the core's rule.

    With `spec_details`, the outcome of a request served by a speculative server carries its
    accept length (its acceptance factor times the server's `accept_length`, when the server's
    profile gives one), as SGLang reports it with `return_spec_tokens_details`.

    With `batch.blocks`, each server with a `cache_tokens` capacity keeps a prefix cache, and
    the router a prefix index per server sized by `index_cache_tokens` (what it believes each
    server holds; default: the servers' own capacities).
    With `routers` (several replicas, or one with a scraped view: `simulator.engine.replica_views`),
    each arrival goes through one of the group's routers and its policy (`policy` is not used);
    a group whose setup is the perfect view runs as one router with its policy.
    """
    table_size = _check(servers, batch, concurrency)
    n = len(batch)
    events = EventQueue()
    out = batch.output_tokens
    budget = [m if m is not None else o for m, o in zip(batch.max_tokens, out, strict=True)]
    caching = batch.blocks is not None and any(
        (m.cache_tokens or 0) // batch.block_tokens > 0 for m in servers
    )
    cached = [0] * n
    prompts = Prompts(batch.prompt_tokens, batch.blocks if caching else None, batch.block_tokens, cached)
    arrival, first, finish = [0.0] * n, [0.0] * n, [0.0] * n
    kinds = server_types(servers)  # `Server`, or `ColocatedServer` for a co-located pair
    states = [
        kinds[i](m, i, events, prompts, table_size, out, batch.accept, budget, first, finish)
        for i, m in enumerate(servers)
    ]
    link(states)
    requests = Requests(batch, batch.features, arrival, first, cached if caching else None, spec_details)
    dispatcher, multi = _dispatcher(states, policy, routers, batch, requests, seed, index_cache_tokens)
    engine = _Engine(states, dispatcher, arrival, n)
    source: OpenLoop | ClosedLoop
    if batch.arrivals is not None:
        source = OpenLoop(batch.arrivals, events, engine.arrive)
    else:
        assert concurrency is not None
        source = ClosedLoop(n, concurrency, warmup, measure, events, engine.arrive)
    engine.connect(source)
    for s in states:  # an open loop is not told of completions: the routers are told directly
        s.finished = dispatcher.finished if isinstance(source, OpenLoop) else engine.finished
    source.start()
    if multi is not None:
        _Scraper(multi, events).start()
    events.run()
    return RawRun(
        arrival=arrival,
        first_token=first,
        finish=finish,
        server=engine.where,
        phase=source.phase,
        output_tokens=out,
        servers=tuple(servers),
        prompt_tokens=batch.prompt_tokens,
        cached_tokens=cached if caching else None,
    )


class _Engine:
    """Arrivals to their servers through the routers, completions back to the routers (their
    policies) and to the source (a closed loop's clients)."""

    __slots__ = ("arrival", "arrived", "done", "route", "served", "states", "where")

    def __init__(
        self, states: Sequence[Server], dispatcher: Dispatcher, arrival: list[float], n: int
    ) -> None:
        self.states = states
        self.route = dispatcher.route
        self.done = dispatcher.finished
        self.arrival = arrival
        self.where = [-1] * n
        """Per request: the index of the server it was sent to (-1: never sent)."""
        self.arrived: Callable[[int], None] = _ignore
        self.served: Callable[[Sequence[int], float], None] = _ignore_done

    def connect(self, source: OpenLoop | ClosedLoop) -> None:
        """Arrivals and completions are reported to `source`."""
        self.arrived = source.arrived
        self.served = source.finished

    def arrive(self, a: int, t: float) -> None:
        """The arrival event of request `a`."""
        self.arrival[a] = t
        self.arrived(a)
        si = self.where[a] = self.route(a, t)
        self.states[si].arrive(a, t)

    def finished(self, done: Sequence[int], s: Server, t: float) -> None:
        self.done(done, s, t)
        self.served(done, t)


def _ignore(a: int) -> None:
    pass


def _ignore_done(done: Sequence[int], t: float) -> None:
    pass


class _Scraper:
    """The replicas' scrapes: each router samples the servers every `scrape_interval_s`, at its
    own phase, while work is pending besides the other routers' scrapes."""

    def __init__(self, multi: Routers, events: EventQueue) -> None:
        self.multi = multi
        self.events = events
        self.pending = 0
        """Scrape events in the queue."""

    def start(self) -> None:
        for r, t0 in enumerate(self.multi.first_scrapes()):
            self.events.at(t0, self.scrape, r)
        self.pending = len(self.multi.phases)

    def scrape(self, r: int, t: float) -> None:
        if len(self.events) >= self.pending:
            self.multi.scrape(r, t)
            self.events.at(t + self.multi.setup.scrape_interval_s, self.scrape, r)
        else:
            self.pending -= 1
