"""One simulated run: a policy on a deployment over a workload, summarised.

The policy object is built once per run through the registry (exactly as the proxy builds it)
and lives across all segments of the workload, so a learning policy carries what it learned
from one sweep level to the next. A single-pool deployment is routed least-loaded within the
pool, without a policy (the "same hardware, no sidecar" reference), and reported as the
policy `least_loaded`.

The policy is built from `profile` (what it believes); the servers run from `server_profile`
when one is given (the truth), so the cost of a wrong profile can be measured. With `oracle`,
each closed-loop level also gets the best static split's throughput on those servers
(`simulator.engine.oracle`) and the run's ratio to it.

Prefix caches: each simulated server's capacity is its mode's `cache_tokens` in the server
profile, the router's prefix index believes the policy profile's; `cache_tokens` overrides both.

With `routers` (`simulator.engine.replica_views.RouterSetup`), the arrivals go through that many
routers, each with its own policy instance (built the same way, same seed) and its own scraped
view; the run's result then carries the setup and how often the routers' views disagreed. The
default is one router with the perfect view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.ladder import Ladder
from policies.profile import Profile
from policies.registry import PolicyRegistry, default_registry
from policies.spec import PolicyContext
from simulator.engine.deployment import (
    DEFAULT_LADDER,
    ServerKind,
    ServerModel,
    build_deployment,
)
from simulator.engine.loop import RequestBatch, simulate
from simulator.engine.oracle import best_static_split
from simulator.engine.replica_views import PERFECT_VIEW, RouterGroup, RouterSetup
from simulator.engine.results import RunResult, samples, summarize
from simulator.engine.workloads import Segment

SINGLE_POOL_POLICY = "least_loaded"


@dataclass(frozen=True)
class PolicyChoice:
    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    """Parameters as given (strings from the command line are fine: the policy's model
    validates and converts them)."""


def is_single_pool(deployment: Sequence[tuple[ServerKind, int]]) -> bool:
    pools = {"baseline" if kind == "baseline" else "eagle" for kind, n in deployment if n > 0}
    return len(pools) < 2


def typed_params(registry: PolicyRegistry, choice: PolicyChoice) -> dict[str, Any]:
    """The given parameters, validated and converted to their declared types (JSON-ready)."""
    model = registry.parse_params(choice.name, choice.params)
    dumped: dict[str, Any] = model.model_dump(mode="json")
    return {k: dumped[k] for k in choice.params}


def oracle_fields(
    servers: Sequence[ServerModel], concurrency: int, batch: RequestBatch, throughput: float | None
) -> dict[str, Any]:
    """A level's `oracle_throughput_tok_s`, `oracle_ratio` (the run's throughput over it) and
    `oracle_split` (clients per pool in the best split)."""
    best = best_static_split(servers, concurrency, batch)
    split = {"baseline": 0, "eagle": 0}
    for server, k in zip(servers, best.split, strict=True):
        split[server.pool] += k
    ratio = (
        throughput / best.throughput_tok_s if throughput is not None and best.throughput_tok_s > 0 else None
    )
    return {"oracle_throughput_tok_s": best.throughput_tok_s, "oracle_ratio": ratio, "oracle_split": split}


def run(
    profile: Profile,
    choice: PolicyChoice,
    deployment: Sequence[tuple[ServerKind, int]],
    segments: Sequence[Segment],
    *,
    seed: int = 0,
    ladder: Ladder = DEFAULT_LADDER,
    registry: PolicyRegistry | None = None,
    server_profile: Profile | None = None,
    oracle: bool = False,
    spec_details: bool = False,
    cache_tokens: int | None = None,
    routers: RouterSetup = PERFECT_VIEW,
) -> RunResult:
    servers = build_deployment(server_profile or profile, deployment, ladder)
    believed: list[int | None]
    if cache_tokens is not None:
        servers = tuple(replace(m, cache_tokens=cache_tokens) for m in servers)
        believed = [cache_tokens] * len(servers)
    else:
        believed = [
            profile.modes[mode].cache_tokens if mode in profile.modes else None
            for mode in ("eagle" if m.kind == "eagle" else "baseline" for m in servers)
        ]
    group: RouterGroup | None = None
    if is_single_pool(deployment):
        policy = None
        name, params = SINGLE_POOL_POLICY, {}
    else:
        reg = registry or default_registry()
        policy = reg.create(choice.name, choice.params, PolicyContext(profile, seed))
        name, params = choice.name, typed_params(reg, choice)
        if not routers.perfect:
            others = [
                reg.create(choice.name, choice.params, PolicyContext(profile, seed))
                for _ in range(1, routers.routers)
            ]
            group = RouterGroup(routers, [policy, *others])
    parts = []
    levels: list[dict[str, Any]] | None = None
    for k, seg in enumerate(segments):
        raw = simulate(
            servers,
            policy,
            seg.batch,
            concurrency=seg.concurrency,
            warmup=seg.warmup,
            measure=seg.measure,
            seed=seed * 1000 + k,
            spec_details=spec_details,
            index_cache_tokens=believed,
            routers=group,
        )
        part = samples(raw)
        parts.append(part)
        if seg.concurrency is not None:
            levels = levels if levels is not None else []
            level = {**summarize([part]), "concurrency": seg.concurrency}
            if oracle:
                # the oracle's expectations over the requests the level sends (not its spare tail)
                sent = seg.warmup + (seg.measure or len(seg.batch)) + seg.concurrency
                level.update(
                    oracle_fields(servers, seg.concurrency, seg.batch.head(sent), level["throughput_tok_s"])
                )
            levels.append(level)
    return RunResult(
        policy=name,
        params=params,
        deployment={kind: n for kind, n in deployment},
        summary=summarize(parts),
        levels=levels,
        samples=parts,
        views=None if group is None else {**routers.to_json(), **group.stats.to_json()},
    )
