"""Grid search over a policy's parameters on a simulated workload.

Every grid point is an independent, seeded simulation of the same workload, so points run in
parallel over worker processes and the results do not depend on how many there are: the
ranking is sorted by (objective, grid order). The best point is written as a config file
that `specroute serve --config FILE` reads (`policy`, `policy_params`, `profile`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from policies.params import parse_grid_item
from policies.profile import Profile
from policies.registry import PolicyRegistry
from policies.spec import PolicyError
from simulator.engine.deployment import DEFAULT_ADAPTIVE_BUCKETS, ServerKind
from simulator.engine.results import Slo, goodput
from simulator.engine.runner import PolicyChoice, is_single_pool, run, typed_params
from simulator.engine.workloads import WorkloadSpec, generate

Objective = Literal["throughput_tok_s", "mean_e2e_s", "p99_ttft_s", "p99_e2e_s", "goodput"]
OBJECTIVES: tuple[Objective, ...] = ("throughput_tok_s", "mean_e2e_s", "p99_ttft_s", "p99_e2e_s", "goodput")
MAXIMISED: frozenset[Objective] = frozenset({"throughput_tok_s", "goodput"})
OBJECTIVE_UNITS: dict[str, str] = {
    "throughput_tok_s": "total output tok/s; higher is better",
    "mean_e2e_s": "seconds; lower is better",
    "p99_ttft_s": "seconds; lower is better",
    "p99_e2e_s": "seconds; lower is better",
    "goodput": "requests/s meeting every SLO given; higher is better",
}


class TuneError(ValueError):
    """A grid or objective that cannot be used."""


Grid = Sequence[tuple[str, list[Any]]]
"""(parameter, values to try) in the order given."""


def parse_grid(items: Sequence[str]) -> list[tuple[str, list[Any]]]:
    """`KEY=V1,V2,...` entries (the `policies.params` grammar), in the order given; keys must be
    distinct."""
    grid: list[tuple[str, list[Any]]] = []
    for item in items:
        key, vals = parse_grid_item(item)
        if any(key == k for k, _ in grid):
            raise TuneError(f"--grid: {key!r} given twice")
        grid.append((key, vals))
    if not grid:
        raise TuneError("tune needs at least one --grid KEY=V1,V2,...")
    return grid


def grid_points(base: Mapping[str, Any], grid: Grid) -> list[dict[str, Any]]:
    keys = [k for k, _ in grid]
    return [
        {**base, **dict(zip(keys, combo, strict=True))} for combo in itertools.product(*(v for _, v in grid))
    ]


def valid_points(
    registry: PolicyRegistry,
    policy: str,
    base: Mapping[str, Any],
    grid: Grid,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[tuple[dict[str, Any], str]]]:
    """The grid points the policy accepts, their typed parameters, and the rejected points with
    the reason.

    A combination the policy rejects is skipped; a value that no combination makes valid (e.g.
    threshold=0) is the user's error and raises the policy's PolicyError, as does a grid with
    no valid point at all."""
    points: list[dict[str, Any]] = []
    typed: list[dict[str, Any]] = []
    skipped: list[tuple[dict[str, Any], str]] = []
    first_error: PolicyError | None = None
    for point in grid_points(base, grid):
        try:
            typed.append(typed_params(registry, PolicyChoice(policy, point)))
        except PolicyError as e:
            first_error = first_error or e
            skipped.append((point, str(e)))
        else:
            points.append(point)
    if first_error is not None and not points:
        raise first_error
    for key, values in grid:
        for value in values:
            if not any(p[key] == value for p in points):
                reason = next(r for p, r in skipped if p[key] == value)
                raise PolicyError(f"--grid {key}={value} is valid in no combination: {reason}")
    return points, typed, skipped


@dataclass(frozen=True)
class Task:
    profile: Profile
    choice: PolicyChoice
    deployment: tuple[tuple[ServerKind, int], ...]
    workload: WorkloadSpec
    seed: int
    buckets: tuple[tuple[int, float], ...]
    slo: Slo
    server_profile: Profile | None = None
    spec_details: bool = False
    cache_tokens: int | None = None


@dataclass(frozen=True)
class PointResult:
    index: int
    params: dict[str, Any]
    summary: dict[str, Any]
    goodput_rps: float
    score: float
    """The objective's value (NaN when undefined: ranked last)."""


def evaluate(task: Task) -> tuple[dict[str, Any], float]:
    """Simulate one grid point (top-level so worker processes can run it)."""
    segments = generate(task.workload, task.seed)
    result = run(
        task.profile,
        task.choice,
        task.deployment,
        segments,
        seed=task.seed,
        buckets=task.buckets,
        server_profile=task.server_profile,
        spec_details=task.spec_details,
        cache_tokens=task.cache_tokens,
    )
    return result.summary, goodput(result.samples, task.slo)


def score_of(objective: Objective, summary: Mapping[str, Any], good: float) -> float:
    value = good if objective == "goodput" else summary.get(objective)
    return float(value) if isinstance(value, int | float) else math.nan


def rank(results: Sequence[PointResult], objective: Objective) -> list[PointResult]:
    """Best first; throughput and goodput are maximised, latencies minimised; NaN last.

    Ties (e.g. every point meets the SLOs) go to the lower mean end-to-end time, then to grid order.
    """
    sign = -1.0 if objective in MAXIMISED else 1.0

    def key(r: PointResult) -> tuple[bool, float, float, int]:
        mean = r.summary.get("mean_e2e_s")
        tie = float(mean) if isinstance(mean, int | float) else math.inf
        return (math.isnan(r.score), sign * r.score if not math.isnan(r.score) else 0.0, tie, r.index)

    return sorted(results, key=key)


def tune(
    profile: Profile,
    policy: str,
    base_params: Mapping[str, Any],
    grid: Grid,
    deployment: Sequence[tuple[ServerKind, int]],
    workload: WorkloadSpec,
    objective: Objective,
    *,
    registry: PolicyRegistry,
    slo: Slo | None = None,
    seed: int = 0,
    jobs: int = 1,
    buckets: Sequence[tuple[int, float]] = DEFAULT_ADAPTIVE_BUCKETS,
    server_profile: Profile | None = None,
    spec_details: bool = False,
    cache_tokens: int | None = None,
    progress: Callable[[int], object] | None = None,
    on_skip: Callable[[dict[str, Any], str], object] | None = None,
) -> list[PointResult]:
    """Evaluate every valid grid point; returns the ranking (best first).

    Combinations the policy rejects (e.g. threshold's hysteresis >= threshold) are passed to
    `on_skip` and left out; see `valid_points` for when a bad grid is an error instead."""
    if objective not in OBJECTIVES:
        raise TuneError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    if is_single_pool(deployment):
        raise TuneError("tune needs a deployment with both pools (the policy routes between them)")
    points, typed, skipped = valid_points(registry, policy, base_params, grid)
    for point, reason in skipped:
        if on_skip:
            on_skip(point, reason)
        if progress:
            progress(1)
    tasks = [
        Task(
            profile,
            PolicyChoice(policy, p),
            tuple(deployment),
            workload,
            seed,
            tuple(buckets),
            slo or Slo(),
            server_profile,
            spec_details,
            cache_tokens,
        )
        for p in points
    ]
    outputs: list[tuple[dict[str, Any], float]] = []
    if jobs <= 1 or len(tasks) == 1:
        for t in tasks:
            outputs.append(evaluate(t))
            if progress:
                progress(1)
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
            for out in pool.map(evaluate, tasks):
                outputs.append(out)
                if progress:
                    progress(1)
    results = [
        PointResult(i, typed[i], summary, good, score_of(objective, summary, good))
        for i, (summary, good) in enumerate(outputs)
    ]
    return rank(results, objective)


def config_text(
    policy: str,
    params: Mapping[str, Any],
    profile_ref: str,
    *,
    objective: Objective,
    best: PointResult,
    command: str,
) -> str:
    """A `specroute serve --config` file for the best point; backend URLs left to the user."""
    body = yaml.safe_dump(
        {"policy": policy, "policy_params": dict(params), "profile": profile_ref},
        sort_keys=False,
        default_flow_style=False,
    )
    value = best.score
    lines = [
        "# specroute config written by `specroute tune`.",
        f"# command: {command}",
        f"# objective {objective} = {value:.6g} over {best.summary.get('requests')} simulated requests;",
        f"# pool share: {best.summary.get('pool_share')}",
        "# Fill in your backends (one URL or a list per pool):",
        "# baseline: [http://BASELINE-HOST:30000]",
        "# eagle: [http://EAGLE-HOST:30000]",
    ]
    return "\n".join(lines) + "\n" + body


def write_config(path: str | Path, text: str) -> None:
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    except OSError as e:
        # mkdir over a file says only "File exists"
        blocker = next((d for d in p.parents if d.exists() and not d.is_dir()), None)
        detail = f"{blocker} is not a directory" if blocker is not None else e.strerror or e
        raise TuneError(f"{p}: cannot write config: {detail}") from None
