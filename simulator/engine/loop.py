"""The discrete-event engine: requests through simulated servers, routed by a policy.

How it works. Each server is continuous batching modelled as processor sharing with a
load-dependent rate. While `b` requests are running on a server (admitted: in prefill or
decoding, as in the profile's definition of concurrency), every decoding request advances at
`rate(b)` tokens per second. Instead of touching every request at every event, a server keeps
a virtual clock `V` that advances at `rate(b)`; a request that starts decoding at `V0` with
`w` tokens of work finishes when `V` reaches `V0 + w`. Finishing virtual times sit in a
per-server heap, so the next completion's wall time is `T + (heap top - V) / rate` and an
event costs O(log n). EAGLE requests carry their own acceptance factor `a` (mean 1): their
virtual work is `tokens / a`.

A request is admitted at once while the server runs fewer than `max_running_requests`,
otherwise it waits in a FIFO queue. Its first token comes `ttft(b)` after its prefill ends; the
remaining `n - 1` tokens are decoded after that. When the profile gives `prefill_tok_s`, a
server prefills one request at a time, FIFO, at that rate (prefill is compute-bound: long
prompts queue behind each other), and only the prompt tokens its prefix cache does not hold
(`simulator.engine.cache`, when the batch carries block ids and the server has a cache); the
router keeps its own `policies.prefix.PrefixIndex` per server, the same code the proxy uses, and
sets `BackendLoad.cached_tokens` from it for every decision.

The global event heap is keyed by `(time, seq)` with a counter owned by the run. A server's
next completion is rescheduled whenever its rate or heap top changes; the entry whose `seq`
is the server's `done_seq` is the live one, others are skipped. A completion that moves
later (the common case: an arrival slows the batch) is not pushed at once: the server's
earlier entry still in the heap (its carrier) pushes it when it pops, under the `(time,
seq)` key it was given, so events pop in exactly the order of pushing every reschedule.
Policies see the same `LoadView`/`RequestInfo` types as in the proxy, and get
`observe(Outcome)` when a request finishes.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from policies.base import (
    BackendLoad,
    Decision,
    InvalidDecision,
    LoadView,
    Outcome,
    Policy,
    PoolLoad,
    RequestFeatures,
    RequestInfo,
)
from policies.prefix import DEFAULT_BLOCK_TOKENS, PrefixIndex
from policies.routing import Router, least_loaded_index, reset
from policies.view import backend_load, believed_cached, dispatched, load_view
from simulator.engine.cache import BlockCache
from simulator.engine.routers import RouterGroup, Routers
from simulator.engine.servers import ServerModel

_ARRIVE = 0
_FIRST = 1
_DONE = 2
_SCRAPE = 3
_INFO_CACHE_MAX = 1 << 16


class SimulationError(RuntimeError):
    """The simulation cannot proceed (e.g. a policy picked a backend that does not exist)."""


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
        )


WARMUP, MEASURED, FILLER, NOT_SENT = 0, 1, 2, -1


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


class _ClosedLoop:
    """Which request a closed-loop client sends next, by the rule `specroute bench` uses.

    A request that starts while fewer than `warmup` requests have completed is warm-up; the
    next `measure` starts are measured; after that clients send fillers until every measured
    request has finished, so each measured request runs with `concurrency` in flight; then
    they stop. Without `measure` every request is measured and the loop ends with the batch.
    """

    def __init__(self, n: int, warmup: int, measure: int | None) -> None:
        self.n = n
        self.warmup = warmup
        self.measure = measure
        self.sent = 0
        self.completed = 0
        self.measured_started = 0
        self.measured_done = 0

    def done(self, phase: int) -> None:
        self.completed += 1
        if phase == MEASURED:
            self.measured_done += 1

    def next_phase(self) -> int:
        if self.sent >= self.n:
            return NOT_SENT
        if self.measure is None:
            return MEASURED
        if self.completed < self.warmup:
            return WARMUP
        if self.measured_started < self.measure:
            self.measured_started += 1
            return MEASURED
        if self.measured_done < self.measure:
            return FILLER
        return NOT_SENT


class _Server:
    __slots__ = (
        "accept_length",
        "cache",
        "cap",
        "carrier_seq",
        "carrier_t",
        "dheap",
        "dirty",
        "done_seq",
        "done_t",
        "model",
        "name",
        "pool",
        "pool_index",
        "prefill",
        "prefill_free",
        "queue",
        "rate",
        "rate_table",
        "running",
        "slot",
        "speculative",
        "t_last",
        "tokens",
        "ttft_table",
        "v",
    )

    def __init__(self, model: ServerModel, block_tokens: int) -> None:
        self.model = model
        self.name = model.name
        self.pool = model.pool
        self.pool_index = 0 if model.pool == "baseline" else 1
        self.slot = 0
        """Index of this server among its pool's backends (deployment order)."""
        self.accept_length = model.accept_length if model.speculative else None
        self.dirty = True
        """State changed since its `BackendLoad` was last built."""
        self.cap = model.max_running_requests if model.max_running_requests is not None else 1 << 62
        self.prefill = model.prefill_tok_s
        self.prefill_free = 0.0
        """When the prefill of the requests admitted so far ends."""
        cache_blocks = (model.cache_tokens or 0) // block_tokens
        self.cache = BlockCache(cache_blocks) if cache_blocks > 0 else None
        self.rate_table = model.rate
        self.speculative = model.speculative
        self.ttft_table = model.ttft
        self.running = 0
        self.tokens = 0
        self.queue: deque[int] = deque()
        self.dheap: list[tuple[float, int]] = []
        self.v = 0.0
        self.t_last = 0.0
        self.rate = model.rate[0]
        self.done_t = 0.0
        self.done_seq = -1
        """Key of the live completion event (-1: none); it may not be in the heap yet."""
        self.carrier_t = 0.0
        self.carrier_seq = -1
        """Key of this server's earliest entry in the heap (-1: none); it pops no later than
        the live event and pushes it when it is not in the heap yet."""


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
    with `warmup` and `measure` as in `specroute bench` (see `_ClosedLoop`); a closed loop that
    runs out of requests in the batch stops sending.
    Every request is routed by the routing core (`policies.routing.Router`, seeded with
    `seed`), exactly as the proxy routes it; with `policy` None (or all servers in one pool)
    it goes to the least-loaded server by the core's rule.

    With `spec_details`, the outcome of a request served by a speculative server carries its
    accept length (its acceptance factor times the server's `accept_length`, when the server's
    profile gives one), as SGLang reports it with `return_spec_tokens_details`.

    With `batch.blocks`, each server with a `cache_tokens` capacity keeps a prefix cache, and
    the router a prefix index per server sized by `index_cache_tokens` (what it believes each
    server holds; default: the servers' own capacities).
    With `routers` (several replicas, or one with a scraped view: `simulator.engine.routers`),
    each arrival goes through one of the group's routers and its policy (`policy` is not used);
    a group whose setup is the perfect view runs as one router with its policy.
    """
    n = len(batch)
    if not servers:
        raise SimulationError("no servers to simulate")
    if batch.arrivals is None and (concurrency is None or concurrency < 1):
        raise SimulationError("a closed loop needs concurrency >= 1")
    if batch.arrivals is not None and any(
        map(operator.gt, batch.arrivals, itertools.islice(batch.arrivals, 1, None))
    ):
        raise SimulationError("open-loop arrival times must be sorted")
    block_tokens = batch.block_tokens
    if block_tokens < 1:
        raise SimulationError("block_tokens must be >= 1")
    states = [_Server(m, block_tokens) for m in servers]
    table_size = min(len(m.rate) for m in servers)
    if any(len(m.ttft) < table_size for m in servers):
        raise SimulationError("server speed tables must cover the same batch sizes")
    pools = {m.pool for m in servers}
    # A single-pool deployment is routed least-loaded, without the policy.
    # --- replicas (simulator.engine.routers): a perfect-view group is one plain router
    group = routers if routers is not None and len(pools) == 2 else None
    if group is not None and group.setup.perfect:
        policy, group = group.policies[0], None
    elif group is not None:
        policy = group.policies[0]
    routed = policy if policy is not None and len(pools) == 2 and group is None else None
    policy_name = policy.name if policy is not None else ""
    index = {m.name: i for i, m in enumerate(servers)}
    router = Router(seed)
    decide, rng = router.decide, router.rng

    prompt_tokens, output_tokens = batch.prompt_tokens, batch.output_tokens
    max_tokens, hints, accept = batch.max_tokens, batch.hints, batch.accept
    budget = [m if m is not None else o for m, o in zip(max_tokens, output_tokens, strict=True)]
    multi: Routers | None = None
    if group is not None:
        multi = Routers(
            group,
            [(m.name, m.pool, st.accept_length) for m, st in zip(servers, states, strict=True)],
            lambda: ([st.running for st in states], [len(st.queue) for st in states]),
            seed,
            budget,
        )
    # --- end replicas
    arrival = [0.0] * n
    first = [0.0] * n
    finish = [0.0] * n
    where = [-1] * n
    phase = [NOT_SENT] * n
    infos: list[RequestInfo | None] = [None] * n
    decisions: list[Decision | None] = [None] * n
    blocks = batch.blocks
    features = batch.features
    caching = blocks is not None and any(s.cache is not None for s in states)
    cached = [0] * n
    prefill = _Prefill(prompt_tokens, blocks if caching else None, block_tokens, cached)
    indexes = None
    router_indexes: list[list[PrefixIndex]] | None = None
    if blocks is not None and (routed is not None or multi is not None):
        believed = index_cache_tokens or [m.cache_tokens for m in servers]
        if len(believed) != len(servers):
            raise SimulationError("index_cache_tokens needs one capacity per server")
        indexes = [PrefixIndex((c or 0) // block_tokens) for c in believed]
        if multi is not None:
            router_indexes = [
                [PrefixIndex((c or 0) // block_tokens) for c in believed] for _ in range(multi.n)
            ]

    heap: list[tuple[float, int, int, int, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    seq = 0
    arrivals = batch.arrivals
    loop: _ClosedLoop | None = None
    if arrivals is not None:
        phase = [MEASURED] * n
        if n:
            push(heap, (arrivals[0], 0, _ARRIVE, 0, 0))
            seq = 1
    else:
        assert concurrency is not None
        loop = _ClosedLoop(n, warmup, measure)
        for _ in range(concurrency):
            ph = loop.next_phase()
            if ph == NOT_SENT:
                break
            phase[loop.sent] = ph
            push(heap, (0.0, seq, _ARRIVE, loop.sent, 0))
            seq += 1
            loop.sent += 1
    scrapers = 0
    if multi is not None:
        for r, t0 in enumerate(multi.first_scrapes()):
            push(heap, (t0, seq, _SCRAPE, r, 0))
            seq += 1
        scrapers = len(multi.phases)

    # Views are rebuilt only where a server's state changed since the last decision: the
    # frozen dataclasses are the costliest part of an arrival.
    baseline_bls: list[BackendLoad] = []
    eagle_bls: list[BackendLoad] = []
    for s in states:
        bls = eagle_bls if s.pool_index else baseline_bls
        s.slot = len(bls)
        bls.append(BackendLoad(s.name, s.pool, True, 0, 0, 0, 0, s.accept_length, 0.0))
    baseline_load, eagle_load = PoolLoad("baseline", tuple(baseline_bls)), PoolLoad("eagle", tuple(eagle_bls))
    current_view = LoadView(baseline_load, eagle_load)
    info_cache: dict[tuple[int, int | None, str | None, RequestFeatures | None], RequestInfo] = {}
    observe = routed.observe if routed is not None else None
    for p in [routed] if routed is not None else group.policies if group is not None else []:
        reset(p)  # a segment starts: the clock is back at 0

    def build_view() -> LoadView:
        nonlocal current_view, baseline_load, eagle_load
        changed0 = changed1 = False
        for s in states:
            if s.dirty:
                s.dirty = False
                q = len(s.queue)
                bl = BackendLoad(
                    s.name, s.pool, True, s.running + q, s.tokens, s.running, q, s.accept_length, 0.0
                )
                if s.pool_index:
                    eagle_bls[s.slot] = bl
                    changed1 = True
                else:
                    baseline_bls[s.slot] = bl
                    changed0 = True
        if changed0 or changed1:
            if changed0:
                baseline_load = PoolLoad("baseline", tuple(baseline_bls))
            if changed1:
                eagle_load = PoolLoad("eagle", tuple(eagle_bls))
            current_view = LoadView(baseline_load, eagle_load)
        return current_view

    def believed_view(cached: Sequence[int], t: float) -> LoadView:
        """The true load with the router's prefix belief for this request (`policies.view`)."""
        return load_view(
            backend_load(
                s.name,
                s.pool,
                s.running + len(s.queue),
                s.tokens,
                now=t,
                running=s.running,
                queued=len(s.queue),
                sample_time=t,
                accept_length=s.accept_length,
                cached_tokens=c,
            )
            for s, c in zip(states, cached, strict=True)
        )

    def outcome_of(r: int, info: RequestInfo, decision: Decision, s: _Server, t: float) -> Outcome:
        """The outcome of request `r`, finished on `s` at `t`."""
        start = arrival[r]
        accepted = None
        if spec_details and s.speculative and s.accept_length is not None:
            accepted = accept[r] * s.accept_length
        return Outcome(
            info,
            decision,
            start,
            first[r] - start,
            output_tokens[r],
            t - start,
            "ok",
            accepted,
            cached[r] if caching else None,
        )

    def least_loaded() -> int:
        return least_loaded_index([s.running + len(s.queue) for s in states], rng)

    while heap:
        t, _, kind, a, b = pop(heap)
        if kind == _DONE:
            s = states[a]
            if b != s.done_seq:
                if b == s.carrier_seq:
                    if s.done_seq >= 0:  # the live event, deferred: it pops no earlier than now
                        push(heap, (s.done_t, s.done_seq, _DONE, a, s.done_seq))
                        s.carrier_t, s.carrier_seq = s.done_t, s.done_seq
                    else:
                        s.carrier_seq = -1
                continue
            s.done_seq = s.carrier_seq = -1
            dheap = s.dheap
            fv, r = pop(dheap)
            s.v = fv
            s.t_last = t
            done: list[int] | tuple[int]
            if dheap and dheap[0][0] <= fv:
                done = [r]
                while dheap and dheap[0][0] <= fv:
                    done.append(pop(dheap)[1])
            else:
                done = (r,)
            for r in done:
                finish[r] = t
                s.running -= 1
                s.tokens -= budget[r]
            if caching and s.cache is not None:
                prefill.release(s, done)
            s.dirty = True
            while s.queue and s.running < s.cap:
                q = s.queue.popleft()
                running = s.running = s.running + 1
                ft = prefill.end(s, q, t) + (
                    s.ttft_table[running] if running < table_size else s.ttft_table[-1]
                )
                push(heap, (ft, seq, _FIRST, q, a))
                seq += 1
            running = s.running
            rate = s.rate = s.rate_table[running] if running < table_size else s.model.rate_at(running)
            if dheap:  # no carrier: the live event just popped
                done_t = s.done_t = s.carrier_t = t + (dheap[0][0] - fv) / rate
                s.done_seq = s.carrier_seq = seq
                push(heap, (done_t, seq, _DONE, a, seq))
                seq += 1
            if observe is not None:
                for r in done:
                    info, decision = infos[r], decisions[r]
                    if info is not None and decision is not None:
                        observe(outcome_of(r, info, decision, s, t))
                        infos[r] = decisions[r] = None
            elif multi is not None:
                for r in done:
                    info, decision = infos[r], decisions[r]
                    if info is not None and decision is not None:
                        multi.finished(r, a, outcome_of(r, info, decision, s, t))
                        infos[r] = decisions[r] = None
                    else:
                        multi.finished(r, a, None)
            if loop is not None:
                for r in done:
                    loop.done(phase[r])
                    ph = loop.next_phase()
                    if ph != NOT_SENT:
                        phase[loop.sent] = ph
                        push(heap, (t, seq, _ARRIVE, loop.sent, 0))
                        seq += 1
                        loop.sent += 1
        elif kind == _FIRST:
            s = states[b]
            first[a] = t
            out = output_tokens[a] - 1
            if out <= 0:
                # Nothing to decode: finishes with its first token (a zero-work heap entry).
                work = 0.0
            else:
                work = out / accept[a] if s.speculative else float(out)
            dheap = s.dheap
            v = s.v + (t - s.t_last) * s.rate
            s.v = v
            s.t_last = t
            entry = (v + work, a)
            push(dheap, entry)
            if dheap[0] is entry:
                done_t = s.done_t = t + work / s.rate
                s.done_seq = seq
                if s.carrier_seq < 0 or done_t < s.carrier_t:
                    push(heap, (done_t, seq, _DONE, b, seq))
                    s.carrier_t, s.carrier_seq = done_t, seq
                seq += 1
        elif kind == _SCRAPE:
            assert multi is not None
            if len(heap) >= scrapers:  # work is pending besides the other routers' scrapes
                multi.scrape(a, t)
                push(heap, (t + multi.setup.scrape_interval_s, seq, _SCRAPE, a, 0))
                seq += 1
            else:
                scrapers -= 1
        else:
            arrival[a] = t
            if arrivals is not None and a + 1 < n:
                push(heap, (arrivals[a + 1], seq, _ARRIVE, a + 1, 0))
                seq += 1
            if routed is not None or multi is not None:
                ikey = (prompt_tokens[a], max_tokens[a], hints[a], None if features is None else features[a])
                info = info_cache.get(ikey)
                if info is None:
                    if len(info_cache) >= _INFO_CACHE_MAX:
                        info_cache.clear()
                    info = RequestInfo(
                        endpoint="chat",
                        stream=True,
                        prompt_tokens=ikey[0],
                        max_tokens=ikey[1],
                        hint=ikey[2],
                        features=ikey[3],
                    )
                    info_cache[ikey] = info
                try:
                    if multi is not None:
                        believe = None
                        if router_indexes is not None:
                            assert blocks is not None
                            believe = partial(
                                _believed_by, router_indexes, blocks[a], block_tokens, prompt_tokens[a]
                            )
                        decision = multi.decide(a, info, t, believe)
                    else:
                        assert routed is not None
                        if indexes is not None:
                            assert blocks is not None
                            view = believed_view(
                                _believed(indexes, blocks[a], block_tokens, prompt_tokens[a]), t
                            )
                        else:
                            view = build_view()
                        decision = decide(routed, info, view, t)
                except InvalidDecision as e:
                    raise SimulationError(
                        f"policy {policy_name!r} {e} (deployment: {', '.join(index)})"
                    ) from None
                si = index[decision.backend]
                if indexes is not None:
                    assert blocks is not None
                    # each router's index learns from its own dispatches only, as a replica's does
                    if multi is not None and router_indexes is not None:
                        dispatched(router_indexes[multi.owner[a]][si], blocks[a])
                    else:
                        dispatched(indexes[si], blocks[a])
                infos[a] = info
                decisions[a] = decision
            else:
                si = least_loaded()
            where[a] = si
            s = states[si]
            s.tokens += budget[a]
            s.dirty = True
            if s.running < s.cap:
                # Advance the virtual clock at the old rate before the batch grows.
                s.v += (t - s.t_last) * s.rate
                s.t_last = t
                running = s.running = s.running + 1
                rate = s.rate = s.rate_table[running] if running < table_size else s.model.rate_at(running)
                ft = prefill.end(s, a, t) + (
                    s.ttft_table[running] if running < table_size else s.ttft_table[-1]
                )
                push(heap, (ft, seq, _FIRST, a, si))
                seq += 1
                if s.dheap:
                    # Float rounding may put V a hair past the top: never schedule in the past.
                    ahead = s.dheap[0][0] - s.v
                    done_t = s.done_t = t + ahead / rate if ahead > 0.0 else t
                    s.done_seq = seq
                    if s.carrier_seq < 0 or done_t < s.carrier_t:
                        push(heap, (done_t, seq, _DONE, si, seq))
                        s.carrier_t, s.carrier_seq = done_t, seq
                    seq += 1
            else:
                s.queue.append(a)

    return RawRun(
        arrival=arrival,
        first_token=first,
        finish=finish,
        server=where,
        phase=phase,
        output_tokens=output_tokens,
        servers=tuple(servers),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached if caching else None,
    )


class _Prefill:
    """Admission of a request to a server: its prefix-cache hit and when its prefill ends."""

    __slots__ = ("block_tokens", "blocks", "cached", "prompt_tokens")

    def __init__(
        self,
        prompt_tokens: Sequence[int],
        blocks: Sequence[Sequence[int]] | None,
        block_tokens: int,
        cached: list[int],
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.blocks = blocks
        self.block_tokens = block_tokens
        self.cached = cached

    def end(self, s: _Server, r: int, t: float) -> float:
        """Request `r` is admitted to `s` at `t`: when its prefill ends (the first token follows
        `ttft(b)` later). It references its blocks in the cache until `release`."""
        todo = self.prompt_tokens[r]
        cache, blocks = s.cache, self.blocks
        if cache is not None and blocks is not None:
            hit = cache.acquire(blocks[r]) * self.block_tokens
            hit = hit if hit < todo else todo
            self.cached[r] = hit
            todo -= hit
        if s.prefill is None or todo <= 0:
            return t
        start = t if t > s.prefill_free else s.prefill_free
        s.prefill_free = start + todo / s.prefill
        return s.prefill_free

    def release(self, s: _Server, done: Sequence[int]) -> None:
        cache, blocks = s.cache, self.blocks
        if cache is not None and blocks is not None:
            for r in done:
                cache.release(blocks[r])


def _believed(
    indexes: Sequence[PrefixIndex], blocks: Sequence[int], block_tokens: int, prompt_tokens: int
) -> list[int]:
    """Per server, the tokens of this prompt its router's prefix index believes it holds."""
    return [believed_cached(idx, blocks, prompt_tokens, block_tokens) for idx in indexes]


def _believed_by(
    indexes: Sequence[Sequence[PrefixIndex]],
    blocks: Sequence[int],
    block_tokens: int,
    prompt_tokens: int,
    r: int,
) -> list[int]:
    """`_believed` with router `r`'s own prefix indexes (several routers: each its own)."""
    return _believed(indexes[r], blocks, block_tokens, prompt_tokens)
