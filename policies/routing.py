"""The routing core: which backend of a pool serves a request, and what happens when a pool
has none. Pure code, shared by every policy, the proxy and the simulator.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from policies.base import BackendLoad, Decision, LoadView, NoHealthyBackend, Pool, PoolLoad, other_pool


def least_loaded(pool: PoolLoad, rng: random.Random) -> BackendLoad | None:
    """The healthy backend with the smallest `load`, ties broken by `rng`; None when none is healthy."""
    if len(pool.backends) == 1:  # the common deployment: no ties, no rng draw
        only = pool.backends[0]
        return only if only.healthy else None
    best: list[BackendLoad] = []
    best_load = 0
    for b in pool.backends:
        if not b.healthy:
            continue
        load = b.load
        if not best or load < best_load:
            best, best_load = [b], load
        elif load == best_load:
            best.append(b)
    if not best:
        return None
    if len(best) == 1:
        return best[0]
    return best[rng.randrange(len(best))]


def first_least_loaded(pool: PoolLoad) -> BackendLoad | None:
    """The healthy backend with the smallest `load` (first one on ties), or None."""
    if len(pool.backends) == 1:
        only = pool.backends[0]
        return only if only.healthy else None
    best: BackendLoad | None = None
    best_load = 0
    for b in pool.backends:
        if b.healthy:
            load = b.load
            if best is None or load < best_load:
                best, best_load = b, load
    return best


def backend_counts(backend: BackendLoad) -> tuple[int, int]:
    """(running, queued) of a backend: scraped when fresh, else local in-flight as running.

    Requests this replica has in flight are never fewer than the backend holds for it, so a
    scraped total below the local count is topped up as running.
    """
    if backend.running is None:
        return backend.in_flight, 0
    running, queued = backend.running, backend.queued or 0
    missing = backend.in_flight - running - queued
    return (running + missing, queued) if missing > 0 else (running, queued)


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
    """Build a Decision for `pool`, on its least-loaded healthy backend.

    When `pool` has no healthy backend the other pool is used and the reason becomes
    `"<pool>_unavailable"`. Raises `NoHealthyBackend` when neither has one.
    """
    backend = least_loaded(view.pool(pool), rng)
    if backend is None:
        pool = other_pool(pool)
        reason = f"{other_pool(pool)}_unavailable"
        backend = least_loaded(view.pool(pool), rng)
        if backend is None:
            raise NoHealthyBackend("no healthy backend in either pool")
    return Decision(
        pool,
        backend.name,
        reason,
        predicted_ttft_s or {},
        predicted_e2e_s or {},
        backend.load,
        policy,
    )
