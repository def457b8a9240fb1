"""The routing core: where a request goes, decided in one place for the proxy and the simulator.

Pure code: the proxy does I/O around it, the simulator virtual time; given the same policy
state, request, `LoadView` and seed, both get the same `Decision`. The rules:

1. **Client override.** A request with a `forced_pool` (`x-specroute-mode`, when the config
   allows it) goes to that pool without asking the policy (reason `client_override`). When the
   forced pool has no healthy backend the request fails with `NoHealthyBackend` (the proxy
   answers 503): whoever forces a pool -- a benchmark of one mode, someone debugging one
   server -- expects that pool's answer or an error, never a silent answer from the other one.
2. **The policy picks the pool** (`policy.choose`), with its predictions; it may name a
   backend, or leave `backend` empty for rule 3.
3. **Backend within a pool:** the healthy backend with the smallest `BackendLoad.load` (the
   larger of this replica's in-flight count and the scraped running + queued); ties are
   broken uniformly by the router's seeded RNG. A policy that names a healthy backend of its
   pool keeps it; a backend that is not in the view is an `InvalidDecision`. A policy that
   predicts per backend (cost_model when the prefix index says some backend of the pool holds
   part of the prompt) names the one `cheapest_backend` picks: least predicted cost, then least
   load, then deployment order.
4. **Fallback:** when the chosen pool has no backend that admits, rule 3 in the other pool,
   with reason `<pool>_unavailable`; when neither has one, `NoHealthyBackend`. A policy that
   predicts per pool and finds one pool without an admitting backend asks `fallback` for the
   other pool and the reason, so the rule and its reason are written here only.
5. **Failover** (the proxy, before the first byte reached the client): rule 3 among the
   healthy backends not tried yet, in the same pool first, then -- unless the pool was
   forced -- in the other pool.
6. **Which outcomes teach** (`teaches`): a policy learns speeds only from requests it routed
   that ended "ok" on the backend it chose: not forced by the client (`Outcome.forced`), not
   failed over (`Outcome.failed_over`; its load at decision time was another backend's), and
   whose client took the answer as it came: an outcome whose relay was blocked writing to its
   client (`Outcome.client_blocked_s`) for more than `CLIENT_STALL_SHARE` of its duration does
   not teach. The backend goes on generating while the relay waits on a slow client, so when it
   finished is not known: its decode time lies anywhere between the relay's time without the
   waits and with them, and a client that reads slowly would teach everyone's routing that the
   backend is slow.
7. **Segment start** (`reset`): the simulator calls it on every policy when a segment (a run
   from an empty deployment, clock at 0) begins, so state tied to the clock (queued prefill
   estimates) is dropped; what was learned is kept.

"Admits" (`BackendLoad.admits`) is healthy and not full; a decision's `Decision` is a new value
(the policy's is never changed), except that a policy's decision that already names an admitting
backend of its pool with that backend's `load` as `backend_load` is complete and returned as it
is (cost_model's: one value per decision instead of two).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence

from policies.base import (
    POOLS,
    BackendLoad,
    Decision,
    InvalidDecision,
    LoadView,
    NoHealthyBackend,
    Outcome,
    Policy,
    Pool,
    PoolLoad,
    RequestInfo,
    Resettable,
    other_pool,
)


def least_loaded_index(loads: Sequence[int], rng: random.Random) -> int:
    """Index of the smallest load (rule 3 on plain numbers); ties broken by `rng`.

    `loads` must not be empty. Draws from `rng` only when there is a tie."""
    low = min(loads)
    best = [i for i, load in enumerate(loads) if load == low]
    return best[0] if len(best) == 1 else best[rng.randrange(len(best))]


def pick_backend(pool: PoolLoad, rng: random.Random, exclude: Collection[str] = ()) -> BackendLoad | None:
    """Rule 3: the least-loaded admitting backend of `pool` not in `exclude`; None when none."""
    backends = pool.backends
    if len(backends) == 1:  # the common deployment: no ties, no rng draw
        only = backends[0]
        return only if only.admits and only.name not in exclude else None
    candidates = [b for b in backends if b.admits and b.name not in exclude]
    if not candidates:
        return None
    return candidates[least_loaded_index([b.load for b in candidates], rng)]


def first_least_loaded(pool: PoolLoad) -> BackendLoad | None:
    """The admitting backend with the smallest `load`, the first one on ties, or None.

    What policies predict for: its load is the load of whichever backend rule 3 picks."""
    backends = pool.backends
    if len(backends) == 1:
        only = backends[0]
        return only if only.admits else None
    best: BackendLoad | None = None
    best_load = 0
    for b in backends:
        if b.admits:
            load = b.load
            if best is None or load < best_load:
                best, best_load = b, load
    return best


def cheapest_backend(
    pool: PoolLoad, cost: Callable[[BackendLoad], float]
) -> tuple[BackendLoad, float] | None:
    """The admitting backend of `pool` with the least `cost` (then the least `load`, then the
    first in deployment order) and its cost, or None when no backend of the pool admits."""
    best: BackendLoad | None = None
    best_key = (math.inf, 0)
    for b in pool.backends:
        if b.admits:
            key = (cost(b), b.load)
            if best is None or key < best_key:
                best, best_key = b, key
    return None if best is None else (best, best_key[0])


def pool_decision(
    pool: Pool,
    reason: str,
    *,
    policy: str = "",
    predicted_ttft_s: Mapping[Pool, float] | None = None,
    predicted_e2e_s: Mapping[Pool, float] | None = None,
    backend: str = "",
    accept_factor: float | None = None,
) -> Decision:
    """A decision for `pool`; with `backend` "" the router picks the backend (rule 3)."""
    return Decision(
        pool, backend, reason, predicted_ttft_s or {}, predicted_e2e_s or {}, 0, policy, accept_factor
    )


def unavailable(pool: Pool) -> str:
    """Rule 4's reason: `pool` had no backend that admits."""
    return f"{pool}_unavailable"


def fallback(on: Mapping[Pool, object | None]) -> tuple[Pool, str]:
    """Rule 4 for a policy that predicted per pool: the first pool (deployment order) whose
    prediction `on` holds and the reason `<other pool>_unavailable`; `NoHealthyBackend` when
    neither pool has one."""
    for pool in POOLS:
        if on.get(pool) is not None:
            return pool, unavailable(other_pool(pool))
    raise NoHealthyBackend("no healthy backend in either pool")


CLIENT_STALL_SHARE = 0.05
"""Rule 6: the share of an outcome's duration its relay may have spent blocked on the client
(a write the client did not take at once) and still teach. Below it `Outcome.decode_tok_s`
leaves that time out, so the rate it teaches is off by at most about this share."""


def teaches(outcome: Outcome) -> bool:
    """Rule 6: whether a policy should learn from `outcome`: it ended "ok" on the backend the
    policy chose for it, the policy chose it (not forced), it was not failed over and its client
    did not hold the relay up for more than `CLIENT_STALL_SHARE` of its duration."""
    return (
        outcome.status == "ok"
        and not outcome.failed_over
        and outcome.request.forced_pool is None
        and outcome.client_blocked_s <= CLIENT_STALL_SHARE * outcome.duration_s
    )


def reset(policy: object) -> None:
    """Rule 7: a new segment begins; the policy drops state tied to the clock (if it has any)."""
    if isinstance(policy, Resettable):
        policy.reset()


def route(
    view: LoadView,
    pool: Pool,
    reason: str,
    rng: random.Random,
    *,
    policy: str = "",
    predicted_ttft_s: Mapping[Pool, float] | None = None,
    predicted_e2e_s: Mapping[Pool, float] | None = None,
) -> Decision:
    """A complete decision for `pool` (rules 3 and 4 with `rng`), for policies that want to name
    the backend themselves. Raises `NoHealthyBackend` when neither pool has a healthy backend."""
    decision = pool_decision(
        pool, reason, policy=policy, predicted_ttft_s=predicted_ttft_s, predicted_e2e_s=predicted_e2e_s
    )
    return _complete(decision, view, rng)


def _completed(d: Decision, pool: Pool, backend: BackendLoad, reason: str) -> Decision:
    """`d` sent to `backend` of `pool` (a new value; `d` is left as it is)."""
    return Decision(
        pool,
        backend.name,
        reason,
        d.predicted_ttft_s,
        d.predicted_e2e_s,
        backend.load,
        d.policy,
        d.accept_factor,
    )


def _complete(decision: Decision, view: LoadView, rng: random.Random) -> Decision:
    """Rules 3 and 4 on a policy's decision: the completed decision (a new value)."""
    pool = decision.pool
    if pool == "baseline":
        members, other = view.baseline, view.eagle
    elif pool == "eagle":
        members, other = view.eagle, view.baseline
    else:
        raise InvalidDecision(f"chose pool {pool!r} (expected one of {', '.join(POOLS)})")
    name = decision.backend
    backends = members.backends
    chosen: BackendLoad | None = None
    if len(backends) == 1 and (not name or name == backends[0].name):  # the common case, inlined
        only = backends[0]
        if only.admits:
            chosen = only
    elif name:
        for b in backends:
            if b.name == name:
                if b.admits:
                    chosen = b
                break
        else:
            raise InvalidDecision(f"chose backend {name!r}, which is not in the {pool} pool")
    if chosen is None:
        chosen = pick_backend(members, rng)
    if chosen is not None:
        d = decision
        load = chosen.load
        if name == chosen.name and d.backend_load == load:  # named with its load: already complete
            return d
        return Decision(
            pool,
            chosen.name,
            d.reason,
            d.predicted_ttft_s,
            d.predicted_e2e_s,
            load,
            d.policy,
            d.accept_factor,
        )
    chosen = pick_backend(other, rng)
    if chosen is None:
        raise NoHealthyBackend("no healthy backend in either pool")
    return _completed(decision, other_pool(pool), chosen, unavailable(pool))


class Router:
    """Rules 1-5 with one seeded RNG for every tie-break. The proxy holds one per replica, the
    simulator one per simulated segment."""

    __slots__ = ("rng",)

    def __init__(self, seed: int | str = 0) -> None:
        self.rng = random.Random(seed)

    def decide(self, policy: Policy, request: RequestInfo, view: LoadView, now: float) -> Decision:
        """Where `request` goes. Raises `NoHealthyBackend` (nowhere to go) or `InvalidDecision`
        (the policy chose something that does not exist); the policy's own errors propagate."""
        forced = request.forced_pool
        if forced is not None:
            backend = pick_backend(view.pool(forced), self.rng)
            if backend is None:
                raise NoHealthyBackend(f"pool {forced!r} has no healthy backend")
            return Decision(forced, backend.name, "client_override", {}, {}, backend.load, policy.name)
        return _complete(policy.choose(request, view, now), view, self.rng)

    def failover(
        self, view: LoadView, failed: str, tried: Collection[str], forced: bool
    ) -> BackendLoad | None:
        """Rule 5: where a request goes after backend `failed` did not answer; None when nowhere."""
        pool = next((p for p in POOLS if any(b.name == failed for b in view.pool(p).backends)), None)
        if pool is None:
            raise InvalidDecision(f"backend {failed!r} is not in the view")
        for candidate_pool in (pool,) if forced else (pool, other_pool(pool)):
            backend = pick_backend(view.pool(candidate_pool), self.rng, tried)
            if backend is not None:
                return backend
        return None
