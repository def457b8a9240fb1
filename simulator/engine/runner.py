"""One simulated run: a policy on a deployment over a workload, summarised.

The policy object is built once per run through the registry (exactly as the proxy builds it)
and lives across all segments of the workload, so a learning policy carries what it learned
from one sweep level to the next. A single-pool deployment is routed least-loaded within the
pool, without a policy (the "same hardware, no sidecar" reference), and reported as the
policy `least_loaded`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.profile import Profile
from policies.registry import PolicyRegistry, default_registry
from policies.spec import PolicyContext
from simulator.engine.loop import simulate
from simulator.engine.results import RunResult, samples, summarize
from simulator.engine.servers import DEFAULT_ADAPTIVE_BUCKETS, ServerKind, build_deployment
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


def run(
    profile: Profile,
    choice: PolicyChoice,
    deployment: Sequence[tuple[ServerKind, int]],
    segments: Sequence[Segment],
    *,
    seed: int = 0,
    buckets: Sequence[tuple[int, float]] = DEFAULT_ADAPTIVE_BUCKETS,
    registry: PolicyRegistry | None = None,
) -> RunResult:
    servers = build_deployment(profile, deployment, buckets)
    if is_single_pool(deployment):
        policy = None
        name, params = SINGLE_POOL_POLICY, {}
    else:
        reg = registry or default_registry()
        policy = reg.create(choice.name, choice.params, PolicyContext(profile, seed))
        name, params = choice.name, typed_params(reg, choice)
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
        )
        part = samples(raw)
        parts.append(part)
        if seg.concurrency is not None:
            levels = levels if levels is not None else []
            levels.append({**summarize([part]), "concurrency": seg.concurrency})
    return RunResult(
        policy=name,
        params=params,
        deployment={kind: n for kind, n in deployment},
        summary=summarize(parts),
        levels=levels,
        samples=parts,
    )
