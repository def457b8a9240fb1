"""The best static split of a closed loop: how far a policy is from the best possible.

With `C` clients, a static split keeps `k_i` of them on server `i` (`sum k_i = C`): each sends
its next request to the same server as soon as the previous one finished. Server `i` then runs
`b = min(k_i, cap_i)` requests at all times, so every request there takes (renewal-reward over
the level's requests) `ttft(b) + prompt / prefill_tok_s + (n - 1) / (rate(b) * a)` seconds --
`rate(b)` the per-request decode rate with `b` running, `a` the request's acceptance factor on
a speculative server (1 elsewhere) -- and the server emits

    X_i(k_i) = b * E[n] / (ttft(b) + E[prompt] / prefill_tok_s + E[(n - 1) / a] / rate(b))

output tokens per second (clients beyond the cap wait in its queue and add nothing). The oracle
is `max sum X_i(k_i)` over every split, found exactly by dynamic programming over the servers
(`O(servers * C^2)`); with one baseline and one eagle server it is "k on eagle, C - k on
baseline". The expectations are taken over the level's own requests, and the speeds are the
simulated servers' own tables, so the oracle is the figure a perfect static router would reach
on those servers with that traffic (its steady state: `throughput_tok_s` of a level measured
after a warm-up of at least `C` requests, over at least `10 * C`).

Co-located pairs (`simulator.engine.colocation`): a pair's two servers are one unit of the
search, and a split that gives both of them clients runs each at its together tables (both are
busy at all times in a static split); the search is then over the units in the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from simulator.engine.colocation import pairs
from simulator.engine.deployment import ServerModel
from simulator.engine.loop import RequestBatch


@dataclass(frozen=True)
class Oracle:
    throughput_tok_s: float
    split: tuple[int, ...]
    """Clients per server (in deployment order)."""


def server_throughput(server: ServerModel, clients: int, batch: RequestBatch) -> float:
    """Output tokens per second of `server` with `clients` closed-loop clients on it."""
    if clients <= 0 or not len(batch):
        return 0.0
    b = clients
    if server.max_running_requests is not None and b > server.max_running_requests:
        b = server.max_running_requests
    count = len(batch)
    mean_n = math.fsum(batch.output_tokens) / count
    if server.speculative:
        work = math.fsum((n - 1) / a for n, a in zip(batch.output_tokens, batch.accept, strict=True) if n > 1)
    else:
        work = math.fsum(n - 1 for n in batch.output_tokens if n > 1)
    prefill = 0.0
    if server.prefill_tok_s is not None:
        prefill = math.fsum(p for p in batch.prompt_tokens if p > 0) / count / server.prefill_tok_s
    cycle = server.ttft_at(b) + prefill + work / count / server.rate_at(b)
    return b * mean_n / cycle if cycle > 0 else math.inf


def best_static_split(servers: Sequence[ServerModel], clients: int, batch: RequestBatch) -> Oracle:
    """The split of `clients` over `servers` with the highest total throughput (ties: the first
    split found, units filled in deployment order). A unit is one server, or a co-located pair
    (module's opening)."""
    paired = pairs(servers)
    in_pair = {i for pair in paired for i in pair}
    units: list[tuple[int, ...]] = sorted([*paired, *((i,) for i in range(len(servers)) if i not in in_pair)])
    # best[c] = (throughput, clients per server of each unit) using the units seen so far with c
    # clients on them
    nothing: tuple[tuple[int, ...], ...] = ()
    best = [(0.0, nothing)] + [(-math.inf, nothing)] * clients
    for unit in units:
        gain = [_unit_throughput(servers, unit, c, batch) for c in range(clients + 1)]
        nxt: list[tuple[float, tuple[tuple[int, ...], ...]]] = []
        for c in range(clients + 1):
            top, placed = -math.inf, nothing
            for k in range(c + 1):
                before, so_far = best[c - k]
                total = before + gain[k][0]
                if total > top:
                    top, placed = total, (*so_far, gain[k][1])
            nxt.append((top, placed))
        best = nxt
    throughput, placement = best[clients]
    split = [0] * len(servers)
    for unit, ks in zip(units, placement, strict=True):
        for i, k in zip(unit, ks, strict=True):
            split[i] = k
    return Oracle(throughput, tuple(split))


def _unit_throughput(
    servers: Sequence[ServerModel], unit: tuple[int, ...], c: int, batch: RequestBatch
) -> tuple[float, tuple[int, ...]]:
    """(throughput, clients per server) of the best placement of `c` clients on `unit`: all on a
    single server; on a pair, the best split, each server at its together tables while the other
    has clients."""
    if len(unit) == 1:
        return server_throughput(servers[unit[0]], c, batch), (c,)
    first, second = servers[unit[0]], servers[unit[1]]
    top, where = -math.inf, (c, 0)
    for k in range(c + 1):  # k clients on the second server, c - k on the first
        a = first.together if k > 0 and first.together is not None else first
        b = second.together if c - k > 0 and second.together is not None else second
        total = server_throughput(a, c - k, batch) + server_throughput(b, k, batch)
        if total > top:
            top, where = total, (c - k, k)
    return top, where
