"""Grid search over a policy's parameters on a simulated workload.

Every grid point runs on every seed of `seeds`, each an independent, seeded simulation (a seed
fixes the workload, so the points are compared on the same requests), so the simulations run
in parallel over worker processes and the results do not depend on how many there are. A
point's score is its mean objective over the seeds with a 95% t-interval; the ranking is sorted
by (mean score, mean end-to-end time, grid order), and each point's margin to the next is the
paired interval over the seeds, judged by the planner's tie rule (`policies.stats.paired_margin`:
a tie inside the interval or under `tie_within`). The points whose margin to the best is a tie
are named with it: the simulation cannot tell them apart. The best point is written as a
config file that `specroute serve --config FILE` reads (`policy`, `policy_params`, `profile`).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from policies.ladder import Ladder
from policies.params import parse_grid_item
from policies.profile import Profile
from policies.registry import PolicyRegistry
from policies.spec import PolicyError
from policies.stats import Interval, Margin, interval, paired_margin
from simulator.engine.deployment import DEFAULT_LADDER, ServerKind
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


DEFAULT_SEEDS: tuple[int, ...] = (0, 1, 2)
DEFAULT_TIE_WITHIN = 0.01


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
    ladder: Ladder
    slo: Slo
    server_profile: Profile | None = None
    spec_details: bool = False
    cache_tokens: int | None = None


@dataclass(frozen=True)
class PointResult:
    index: int
    params: dict[str, Any]
    summaries: tuple[dict[str, Any], ...]
    """The run's summary per seed, in `seeds` order."""
    goodputs: tuple[float, ...]
    scores: tuple[float, ...]
    """The objective's value per seed (NaN when undefined: ranked last)."""

    @property
    def score(self) -> Interval:
        """The mean objective over the seeds with its 95% interval."""
        return interval(self.scores)

    @property
    def summary(self) -> dict[str, Any]:
        """The summaries' mean over the seeds (numbers and per-pool shares; other keys the first's)."""
        return mean_summary(self.summaries)

    @property
    def identical(self) -> bool:
        """Every seed gave the same score (to rounding): the workload drew nothing from the seed."""
        return len(set(self.scores)) <= 1 or (max(self.scores) - min(self.scores)) <= 1e-9 * max(
            abs(v) for v in self.scores
        )


def mean_summary(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per key: the value when every summary has the same; else the mean over `summaries` of a
    number (None when any lacks it), of a dict of numbers key by key (`pool_share`), or else the
    first summary's value."""
    out: dict[str, Any] = {}
    for key, first in summaries[0].items():
        values = [s.get(key) for s in summaries]
        if all(v == first for v in values):
            out[key] = first
        elif isinstance(first, int | float) and not isinstance(first, bool):
            nums = [v for v in values if isinstance(v, int | float)]
            out[key] = math.fsum(nums) / len(nums) if len(nums) == len(values) else None
        elif isinstance(first, dict) and all(_numbers(v, first) for v in values):
            dicts = [v for v in values if isinstance(v, dict)]
            out[key] = {k: math.fsum(float(d[k]) for d in dicts) / len(dicts) for k in first}
        else:
            out[key] = first
    return out


def _numbers(value: Any, like: Mapping[str, Any]) -> bool:
    """`value` is a dict with `like`'s keys, every value a number."""
    return (
        isinstance(value, dict)
        and value.keys() == like.keys()
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value.values())
    )


@dataclass(frozen=True)
class TuneResult:
    ranking: list[PointResult]
    """Best first."""
    margins: list[Margin | None]
    """Each point's paired margin to the next in the ranking (None for the last)."""
    tied_with_best: list[PointResult]
    """The other points whose margin to the best is a tie."""
    seeds: tuple[int, ...]

    @property
    def best(self) -> PointResult:
        return self.ranking[0]

    @property
    def identical_seeds(self) -> bool:
        """Every point got the same score on every seed (and there were several seeds)."""
        return len(self.seeds) > 1 and all(r.identical for r in self.ranking)


def evaluate(task: Task) -> tuple[dict[str, Any], float]:
    """Simulate one grid point (top-level so worker processes can run it)."""
    segments = generate(task.workload, task.seed)
    result = run(
        task.profile,
        task.choice,
        task.deployment,
        segments,
        seed=task.seed,
        ladder=task.ladder,
        server_profile=task.server_profile,
        spec_details=task.spec_details,
        cache_tokens=task.cache_tokens,
    )
    return result.summary, goodput(result.samples, task.slo)


def score_of(objective: Objective, summary: Mapping[str, Any], good: float) -> float:
    value = good if objective == "goodput" else summary.get(objective)
    return float(value) if isinstance(value, int | float) else math.nan


def rank(results: Sequence[PointResult], objective: Objective) -> list[PointResult]:
    """Best first by mean score; throughput and goodput are maximised, latencies minimised; NaN last.

    Equal means (e.g. every point meets the SLOs) go to the lower mean end-to-end time, then to
    grid order.
    """
    sign = -1.0 if objective in MAXIMISED else 1.0

    def key(r: PointResult) -> tuple[bool, float, float, int]:
        score = r.score.mean
        mean = r.summary.get("mean_e2e_s")
        tie = float(mean) if isinstance(mean, int | float) else math.inf
        return (math.isnan(score), sign * score if not math.isnan(score) else 0.0, tie, r.index)

    return sorted(results, key=key)


def judge(
    ranking: Sequence[PointResult], objective: Objective, seeds: Sequence[int], tie_within: float
) -> TuneResult:
    """The margins of a ranking (see the module note)."""
    higher = objective in MAXIMISED

    def margin(better: PointResult, worse: PointResult) -> Margin:
        return paired_margin(better.scores, worse.scores, higher_is_better=higher, tie_within=tie_within)

    margins: list[Margin | None] = [
        margin(r, ranking[i + 1]) if i + 1 < len(ranking) else None for i, r in enumerate(ranking)
    ]
    best = ranking[0]
    tied = [r for r in ranking[1:] if margin(best, r).verdict == "tie"]
    return TuneResult(list(ranking), margins, tied, tuple(seeds))


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
    seeds: Sequence[int] = DEFAULT_SEEDS,
    tie_within: float = DEFAULT_TIE_WITHIN,
    jobs: int = 1,
    ladder: Ladder = DEFAULT_LADDER,
    server_profile: Profile | None = None,
    spec_details: bool = False,
    cache_tokens: int | None = None,
    progress: Callable[[int], object] | None = None,
    on_skip: Callable[[dict[str, Any], str], object] | None = None,
) -> TuneResult:
    """Evaluate every valid grid point on every seed; returns the ranking (best first) with its
    margins. `progress` is called once per simulation (points x seeds, and once per skipped point).

    Combinations the policy rejects (e.g. threshold's hysteresis >= threshold) are passed to
    `on_skip` and left out; see `valid_points` for when a bad grid is an error instead."""
    if objective not in OBJECTIVES:
        raise TuneError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise TuneError("tune needs one or more distinct seeds")
    if not 0.0 <= tie_within < 1.0:
        raise TuneError("the tie tolerance must be between 0 and 100 percent")
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
            ladder,
            slo or Slo(),
            server_profile,
            spec_details,
            cache_tokens,
        )
        for p in points
        for seed in seeds
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
    k = len(seeds)
    results = []
    for i in range(len(points)):
        runs = outputs[i * k : (i + 1) * k]
        results.append(
            PointResult(
                i,
                typed[i],
                tuple(summary for summary, _ in runs),
                tuple(good for _, good in runs),
                tuple(score_of(objective, summary, good) for summary, good in runs),
            )
        )
    return judge(rank(results, objective), objective, seeds, tie_within)


def config_text(
    policy: str,
    params: Mapping[str, Any],
    profile_ref: str,
    *,
    objective: Objective,
    result: TuneResult,
    command: str,
) -> str:
    """A `specroute serve --config` file for the best point; backend URLs left to the user."""
    best = result.best
    body = yaml.safe_dump(
        {"policy": policy, "policy_params": dict(params), "profile": profile_ref},
        sort_keys=False,
        default_flow_style=False,
    )
    score = best.score
    ci = "" if math.isnan(score.half) or result.identical_seeds else f" ±{score.half:.3g}"
    lines = [
        "# specroute config written by `specroute tune`.",
        f"# command: {command}",
        f"# objective {objective} = {score.mean:.6g}{ci} (mean over seeds "
        f"{', '.join(map(str, result.seeds))}, {best.summary.get('requests')} simulated requests each);",
        f"# pool share: {best.summary.get('pool_share')}",
    ]
    if result.tied_with_best:
        shown = "; ".join(json.dumps(r.params) for r in result.tied_with_best)
        lines.append(f"# within the noise of: {shown} (a tie, not a win)")
    lines += [
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
