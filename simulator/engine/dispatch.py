"""The routers of a simulated run: each arrival's server, and each outcome back to a policy.

Every router here builds the policy's `LoadView` with `policies.view` and decides with
`policies.routing.Router`, exactly as the proxy does:

- `LeastLoaded`: no policy (a single-pool deployment): the least-loaded server by the routing
  core's rule (`least_loaded_index`).
- `OneRouter`: one router with the perfect view (the true running and queued counts at every
  decision), its policy, and a prefix index per server when the workload has prompt blocks.
- `Replicas`: several routers, each with its own scraped view, policy and prefix indexes
  (`simulator.engine.replica_views.Routers`).

The interface the engine drives: `route(a, t)` (the server index for request `a`, arriving at
`t`; the request is recorded as dispatched there), `finished(done, s, t)` (requests `done`
finished on server `s` at `t`: outcomes go to the policies), `scrape(router, t)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Protocol

from policies.base import (
    BackendLoad,
    Decision,
    InvalidDecision,
    LoadView,
    Outcome,
    Policy,
    PoolLoad,
    RequestInfo,
)
from policies.prefix import PrefixIndex
from policies.routing import Router, least_loaded_index
from policies.view import backend_load, believed_cached, dispatched, load_view, true_load
from simulator.engine.errors import SimulationError
from simulator.engine.replica_views import Routers
from simulator.engine.server import Server

_INFO_CACHE_MAX = 1 << 16


class Columns(Protocol):
    """What the routers read of the batch (`simulator.engine.loop.RequestBatch`)."""

    @property
    def prompt_tokens(self) -> Sequence[int]: ...
    @property
    def output_tokens(self) -> Sequence[int]: ...
    @property
    def max_tokens(self) -> Sequence[int | None]: ...
    @property
    def hints(self) -> Sequence[str | None]: ...
    @property
    def hints_seen(self) -> bool: ...
    @property
    def accept(self) -> Sequence[float]: ...


class Dispatcher(Protocol):
    def route(self, a: int, t: float) -> int: ...

    def finished(self, done: Sequence[int], s: Server, t: float) -> None: ...


class LeastLoaded:
    """No policy: the least-loaded server (running + queued), ties by the router's seeded RNG."""

    def __init__(self, servers: Sequence[Server], seed: int) -> None:
        self.servers = servers
        self.rng = Router(seed).rng

    def route(self, a: int, t: float) -> int:
        return least_loaded_index([s.running + len(s.queue) for s in self.servers], self.rng)

    def finished(self, done: Sequence[int], s: Server, t: float) -> None:
        pass


class Requests:
    """Per request: its `RequestInfo` (shared between equal requests), and its decision and
    outcome while it runs."""

    def __init__(
        self,
        batch: Columns,
        features: Sequence[object] | None,
        arrival: list[float],
        first: list[float],
        cached: list[int] | None,
        spec_details: bool,
    ) -> None:
        n = len(batch.output_tokens)
        self.batch = batch
        self.prompt_tokens = batch.prompt_tokens
        self.max_tokens = batch.max_tokens
        self.hints = batch.hints if batch.hints_seen else [None] * n
        self.output_tokens = batch.output_tokens
        self.accept = batch.accept
        self.features = features
        self.arrival = arrival
        self.first = first
        self.cached = cached
        self.spec_details = spec_details
        self.infos: list[RequestInfo | None] = [None] * n
        self.decisions: list[Decision | None] = [None] * n
        self._cache: dict[tuple[int, int | None, str | None, object], RequestInfo] = {}

    def info(self, a: int) -> RequestInfo:
        features = self.features
        f = None if features is None else features[a]
        key = (self.prompt_tokens[a], self.max_tokens[a], self.hints[a], f)
        info = self._cache.get(key)
        if info is None:
            if len(self._cache) >= _INFO_CACHE_MAX:
                self._cache.clear()
            info = RequestInfo(
                endpoint="chat",
                stream=True,
                prompt_tokens=key[0],
                max_tokens=key[1],
                hint=key[2],
                features=key[3],  # type: ignore[arg-type]
            )
            self._cache[key] = info
        return info

    def sent(self, a: int, info: RequestInfo, decision: Decision) -> None:
        self.infos[a] = info
        self.decisions[a] = decision

    def outcome(self, r: int, s: Server, t: float) -> Outcome | None:
        """The outcome of request `r`, finished on `s` at `t` (None: it was not routed by a
        policy); forgets its decision."""
        info, decision = self.infos[r], self.decisions[r]
        if info is None or decision is None:
            return None
        self.infos[r] = self.decisions[r] = None
        start = self.arrival[r]
        accepted = None
        if self.spec_details and s.speculative and s.accept_length is not None:
            accepted = self.accept[r] * s.accept_length
        cached = self.cached
        return Outcome(
            info,
            decision,
            start,
            self.first[r] - start,
            self.output_tokens[r],
            t - start,
            "ok",
            accepted,
            cached[r] if cached is not None else None,
        )


def _fail(policy: str, e: InvalidDecision, servers: Sequence[Server]) -> SimulationError:
    return SimulationError(f"policy {policy!r} {e} (deployment: {', '.join(s.name for s in servers)})")


class OneRouter:
    """One router with the perfect view, its policy and (with prompt blocks) a prefix index per
    server. Views are rebuilt only where a server's state changed since the last decision
    (building them is the costliest part of an arrival), except with prefix indexes, whose
    belief differs per request."""

    def __init__(
        self,
        servers: Sequence[Server],
        policy: Policy,
        seed: int,
        requests: Requests,
        blocks: Sequence[Sequence[int]] | None,
        indexes: Sequence[PrefixIndex] | None,
        block_tokens: int,
    ) -> None:
        self.servers = servers
        self.policy = policy
        self.router = Router(seed)
        self.decide = self.router.decide
        self.observe = policy.observe
        self.requests = requests
        self.blocks = blocks
        self.indexes = indexes if blocks is not None else None
        self.block_tokens = block_tokens
        self.index = {s.name: s.index for s in servers}
        self.pools: tuple[list[BackendLoad], list[BackendLoad]] = ([], [])
        for s in servers:
            bls = self.pools[s.pool_index]
            s.slot = len(bls)
            bls.append(self._load(s, 0.0))
        self.loads = (PoolLoad("baseline", tuple(self.pools[0])), PoolLoad("eagle", tuple(self.pools[1])))
        self.current = LoadView(*self.loads)

    @staticmethod
    def _load(s: Server, t: float, cached: int = 0) -> BackendLoad:
        """The true load of `s` at `t`: every request there is this router's, the sample fresh."""
        q = len(s.queue)
        return backend_load(
            s.name,
            s.pool,
            s.running + q,
            s.tokens,
            now=t,
            running=s.running,
            queued=q,
            sample_time=t,
            accept_length=s.accept_length,
            cached_tokens=cached,
        )

    def view(self, a: int, t: float) -> LoadView:
        if self.indexes is not None:
            assert self.blocks is not None
            blocks, prompt, bt = self.blocks[a], self.requests.batch.prompt_tokens[a], self.block_tokens
            return load_view(
                self._load(s, t, believed_cached(idx, blocks, prompt, bt))
                for s, idx in zip(self.servers, self.indexes, strict=True)
            )
        changed0 = changed1 = False
        base_bls, eagle_bls = self.pools
        for s in self.servers:
            if s.dirty:
                s.dirty = False
                bl = true_load(s.name, s.pool, s.running, len(s.queue), s.tokens, s.accept_length)
                if s.pool_index:
                    eagle_bls[s.slot] = bl
                    changed1 = True
                else:
                    base_bls[s.slot] = bl
                    changed0 = True
        if changed0 or changed1:
            base, eagle = self.loads
            if changed0:
                base = PoolLoad("baseline", tuple(base_bls))
            if changed1:
                eagle = PoolLoad("eagle", tuple(eagle_bls))
            self.loads = (base, eagle)
            self.current = LoadView(base, eagle)
        return self.current

    def route(self, a: int, t: float) -> int:
        requests = self.requests
        info = requests.info(a)
        try:
            decision = self.decide(self.policy, info, self.view(a, t), t)
        except InvalidDecision as e:
            raise _fail(self.policy.name, e, self.servers) from None
        si = self.index[decision.backend]
        if self.indexes is not None:
            assert self.blocks is not None
            dispatched(self.indexes[si], self.blocks[a])
        requests.infos[a] = info
        requests.decisions[a] = decision
        return si

    def finished(self, done: Sequence[int], s: Server, t: float) -> None:
        observe, outcome_of = self.observe, self.requests.outcome
        for r in done:
            outcome = outcome_of(r, s, t)
            if outcome is not None:
                observe(outcome)


def _believed_by(
    indexes: Sequence[Sequence[PrefixIndex]],
    blocks: Sequence[int],
    prompt_tokens: int,
    block_tokens: int,
    r: int,
) -> list[int]:
    """Per server, the tokens of this prompt router `r`'s prefix index believes it holds."""
    return [believed_cached(idx, blocks, prompt_tokens, block_tokens) for idx in indexes[r]]


class Replicas:
    """Several routers (`simulator.engine.replica_views.Routers`), each with its own prefix indexes."""

    def __init__(
        self,
        multi: Routers,
        servers: Sequence[Server],
        requests: Requests,
        blocks: Sequence[Sequence[int]] | None,
        indexes: Sequence[Sequence[PrefixIndex]] | None,
        block_tokens: int,
    ) -> None:
        self.multi = multi
        self.servers = servers
        self.requests = requests
        self.blocks = blocks
        self.indexes = indexes if blocks is not None else None
        self.block_tokens = block_tokens
        self.index = {s.name: s.index for s in servers}
        self.name = multi.policies[0].name

    def route(self, a: int, t: float) -> int:
        info = self.requests.info(a)
        multi = self.multi
        believe = None
        if self.indexes is not None:
            assert self.blocks is not None
            prompt = self.requests.batch.prompt_tokens[a]
            believe = partial(_believed_by, self.indexes, self.blocks[a], prompt, self.block_tokens)
        try:
            decision = multi.decide(a, info, t, believe)
        except InvalidDecision as e:
            raise _fail(self.name, e, self.servers) from None
        si = self.index[decision.backend]
        if self.indexes is not None:
            assert self.blocks is not None
            # each router's index learns from its own dispatches only, as a replica's does
            dispatched(self.indexes[multi.owner[a]][si], self.blocks[a])
        self.requests.sent(a, info, decision)
        return si

    def finished(self, done: Sequence[int], s: Server, t: float) -> None:
        for r in done:
            self.multi.finished(r, s.index, self.requests.outcome(r, s, t))
