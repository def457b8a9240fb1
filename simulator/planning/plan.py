"""`specroute plan`: which mix of plain, EAGLE-3 and adaptive servers serves a workload best.

How it works.

1. Deployments: every split of `N` servers between `baseline` and `eagle` (N plain, N-1 plain +
   1 EAGLE-3, ..., N EAGLE-3) over the kinds given, plus N `adaptive` servers when that kind is
   given. Adaptive servers are planned only as a whole deployment: an adaptive server already
   turns speculation off under load, so it is the in-engine alternative to the sidecar, and
   putting a routing policy in front of a mix with it would adapt twice on the same signal.
2. Tuning: each mixed deployment (both pools present) is tuned over the policies given, each
   on its grid (defaults in `default_grid`), with the tuner's evaluation of one grid point.
   A point's score is its mean objective over the tuning seeds. Single-pool deployments need
   no policy: they are routed least-loaded (the "same hardware, no sidecar" reference).
3. Evaluation: every deployment, with its chosen policy, runs on the evaluation seeds. The
   tuning seeds are different ones (`TUNING_SEED_OFFSET + s`), so picking the best of many
   grid points does not flatter the mixed deployments' reported figures.
4. Ranking per load factor, best first, with the paired margin to the next (see
   `policies.stats`).

Load factors scale the workload's load: a sweep's concurrency levels are multiplied (rounded,
at least 1), an open-loop rate is multiplied, a trace is replayed faster (its time scale is
divided). Deployments are re-tuned at every load.

Every simulation is an independent task; tasks run in order or on a process pool, and the
results are collected in task order, so the plan is identical for any `jobs`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from policies.ladder import Ladder
from policies.profile import Profile, ProfileError
from policies.registry import PolicyRegistry
from policies.stats import Interval, Margin, interval, paired_margin
from simulator.engine.deployment import (
    DEFAULT_LADDER,
    SERVER_KINDS,
    ServerKind,
    build_deployment,
)
from simulator.engine.results import Slo
from simulator.engine.runner import SINGLE_POOL_POLICY, PolicyChoice, is_single_pool, typed_params
from simulator.engine.workloads import WorkloadSpec
from simulator.planning.tuner import MAXIMISED, Grid, Objective, Task, evaluate, score_of, valid_points

Deployment = tuple[tuple[ServerKind, int], ...]
DEFAULT_POLICIES: tuple[str, ...] = ("cost_model", "threshold", "online")
DEFAULT_LOADS: tuple[float, ...] = (0.5, 1.0, 1.5)
DEFAULT_SEEDS: tuple[int, ...] = (0, 1, 2)
DEFAULT_TIE_WITHIN = 0.01
TUNING_SEED_OFFSET = 1_000_000
_THRESHOLDS_PER_EAGLE_SERVER = (2, 4, 8, 16, 32)


class PlanError(ValueError):
    """A plan request that cannot be carried out."""


def enumerate_deployments(servers: int, kinds: Sequence[ServerKind]) -> list[Deployment]:
    """Every deployment of `servers` servers over `kinds`, plain-heaviest first."""
    if servers < 1:
        raise PlanError("--servers must be >= 1")
    unknown = [k for k in kinds if k not in SERVER_KINDS]
    if unknown or not kinds:
        raise PlanError(f"unknown server kind(s) {unknown}; known: {', '.join(SERVER_KINDS)}")
    out: list[Deployment] = []
    if "baseline" in kinds and "eagle" in kinds:
        for eagle in range(servers + 1):
            split: Deployment = (("baseline", servers - eagle), ("eagle", eagle))
            out.append(tuple((k, n) for k, n in split if n))
    else:
        out += [((kind, servers),) for kind in ("baseline", "eagle") if kind in kinds]
    if "adaptive" in kinds:
        out.append((("adaptive", servers),))
    return out


def deployment_label(dep: Deployment) -> str:
    return ",".join(f"{kind}={n}" for kind, n in dep)


def eagle_pool_servers(dep: Deployment) -> int:
    return sum(n for kind, n in dep if kind != "baseline")


def default_grid(policy: str, dep: Deployment) -> list[dict[str, Any]]:
    """The parameter points tried for `policy` on a mixed deployment.

    - threshold: threshold in {2, 4, 8, 16, 32} per eagle server (the policy compares the whole
      eagle pool's load), hysteresis 0 or a quarter of the threshold;
    - cost_model: objective e2e or ttft; online: epsilon 0.02 or 0.05;
    - any other policy: its defaults.
    """
    if policy == "threshold":
        n = eagle_pool_servers(dep)
        points: list[dict[str, Any]] = []
        for t in _THRESHOLDS_PER_EAGLE_SERVER:
            points.append({"threshold": t * n, "hysteresis": 0})
            points.append({"threshold": t * n, "hysteresis": max(1, t * n // 4)})
        return points
    if policy == "cost_model":
        return [{"objective": "e2e"}, {"objective": "ttft"}]
    if policy == "online":
        return [{"epsilon": 0.02}, {"epsilon": 0.05}]
    return [{}]


@dataclass(frozen=True)
class PlanSpec:
    """What to plan: everything but the profile, the registry and the execution settings."""

    servers: int
    kinds: tuple[ServerKind, ...]
    workload: WorkloadSpec
    objective: Objective
    policies: tuple[str, ...] = DEFAULT_POLICIES
    grids: Mapping[str, Grid] = dataclasses.field(default_factory=dict)
    """Per policy, a grid (KEY, values) replacing its default grid."""
    base_params: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """Per policy, parameters applied to every point of its grid."""
    slo: Slo = dataclasses.field(default_factory=Slo)
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    loads: tuple[float, ...] = DEFAULT_LOADS
    ladder: Ladder = DEFAULT_LADDER
    """The adaptive servers' draft depth by batch size."""
    tie_within: float = DEFAULT_TIE_WITHIN
    """Margins up to this fraction of the better objective value are ties (see policies.stats)."""

    @property
    def higher_is_better(self) -> bool:
        return self.objective in MAXIMISED

    @property
    def tuning_seeds(self) -> tuple[int, ...]:
        return tuple(TUNING_SEED_OFFSET + s for s in self.seeds)


def scale_workload(spec: WorkloadSpec, factor: float) -> WorkloadSpec:
    """The workload at `factor` times its load (see the module note)."""
    if factor == 1.0:
        return spec
    if spec.kind == "sweep":
        return dataclasses.replace(spec, levels=tuple(max(1, round(c * factor)) for c in spec.levels))
    if spec.kind == "trace":
        return dataclasses.replace(spec, time_scale=spec.time_scale / factor)
    return dataclasses.replace(spec, rate=spec.rate * factor)


def candidates(spec: PlanSpec, dep: Deployment, registry: PolicyRegistry) -> list[PolicyChoice]:
    """The (policy, typed params) points tried on a deployment, in a fixed order."""
    if is_single_pool(dep):
        return [PolicyChoice(SINGLE_POOL_POLICY, {})]
    out: list[PolicyChoice] = []
    for policy in spec.policies:
        base = dict(spec.base_params.get(policy, {}))
        grid = spec.grids.get(policy)
        if grid:  # combinations the policy rejects are left out (as `specroute tune` does)
            try:
                typed = valid_points(registry, policy, base, grid)[1]
            except ValueError as e:  # PolicyError
                raise PlanError(f"policy {policy!r}: {e}") from None
            out.extend(PolicyChoice(policy, t) for t in typed)
            continue
        for p in [{**base, **p} for p in default_grid(policy, dep)]:
            try:
                out.append(PolicyChoice(policy, typed_params(registry, PolicyChoice(policy, p))))
            except ValueError as e:  # PolicyError: name the policy and the point
                raise PlanError(f"policy {policy!r} with {p}: {e}") from None
    return out


@dataclass(frozen=True)
class Entry:
    """One deployment at one load: its chosen policy and its figures on the evaluation seeds."""

    deployment: Deployment
    order: int
    """Position in the deployment enumeration (breaks exact ties in the ranking)."""
    choice: PolicyChoice
    tuned_points: int
    scores: tuple[float, ...]
    summaries: tuple[dict[str, Any], ...]
    goodputs: tuple[float, ...]

    @property
    def label(self) -> str:
        return deployment_label(self.deployment)

    @property
    def score(self) -> Interval:
        return interval(self.scores)

    def mean(self, key: str) -> float:
        """Mean over seeds of a summary figure (NaN when a seed has none)."""
        values = [s.get(key) for s in self.summaries]
        return interval([float(v) if isinstance(v, int | float) else math.nan for v in values]).mean

    def pool_share(self) -> dict[str, float]:
        return {
            pool: math.fsum(s["pool_share"][pool] for s in self.summaries) / len(self.summaries)
            for pool in ("baseline", "eagle")
        }


@dataclass(frozen=True)
class Ranked:
    entry: Entry
    margin: Margin | None
    """To the next entry in the ranking (None for the last)."""


@dataclass(frozen=True)
class LoadResult:
    factor: float
    workload: WorkloadSpec
    ranking: list[Ranked]
    tied_with_best: list[str]
    """Labels of the other deployments whose paired margin to the best is a tie."""

    @property
    def best(self) -> Entry:
        return self.ranking[0].entry


@dataclass(frozen=True)
class PlanResult:
    spec: PlanSpec
    loads: list[LoadResult]
    simulations: int

    @property
    def reference(self) -> LoadResult:
        """The ranking at load factor 1 (the workload as given)."""
        return next(r for r in self.loads if r.factor == 1.0)


def _task(
    profile: Profile, spec: PlanSpec, choice: PolicyChoice, dep: Deployment, wl: WorkloadSpec, seed: int
) -> Task:
    return Task(profile, choice, dep, wl, seed, spec.ladder, spec.slo)


def _run_all(
    tasks: Sequence[Task], objective: Objective, jobs: int, progress: Callable[[int], object] | None
) -> list[tuple[dict[str, Any], float, float]]:
    """(summary, goodput, score) per task, in task order."""
    out: list[tuple[dict[str, Any], float, float]] = []

    def keep(result: tuple[dict[str, Any], float]) -> None:
        summary, good = result
        out.append((summary, good, score_of(objective, summary, good)))
        if progress:
            progress(1)

    if jobs <= 1 or len(tasks) <= 1:
        for t in tasks:
            keep(evaluate(t))
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
            for result in pool.map(evaluate, tasks, chunksize=1):
                keep(result)
    return out


def count_simulations(spec: PlanSpec, registry: PolicyRegistry) -> int:
    deps = enumerate_deployments(spec.servers, spec.kinds)
    tuning = sum(len(c) for c in (candidates(spec, d, registry) for d in deps) if len(c) > 1)
    return len(spec.loads) * (tuning * len(spec.seeds) + len(deps) * len(spec.seeds))


def _better(a: float, b: float, higher_is_better: bool) -> bool:
    if math.isnan(b):
        return not math.isnan(a)
    if math.isnan(a):
        return False
    return a > b if higher_is_better else a < b


def check_spec(spec: PlanSpec) -> None:
    """The spec's own settings (seeds, loads, tie tolerance, SLOs); PlanError when wrong."""
    if not spec.seeds:
        raise PlanError("at least one seed is needed")
    if len(set(spec.seeds)) != len(spec.seeds):
        raise PlanError("seeds must be distinct")
    if not spec.loads or any(not (f > 0 and math.isfinite(f)) for f in spec.loads):
        raise PlanError("load factors must be positive numbers")
    if 1.0 not in spec.loads:
        raise PlanError("load factors must include 1 (the workload as given)")
    if not 0.0 <= spec.tie_within < 1.0:
        raise PlanError("the tie tolerance must be between 0 and 100 percent")
    if spec.objective == "goodput" and spec.slo.ttft_s is None and spec.slo.tpot_s is None:
        raise PlanError("--objective goodput needs --slo-ttft and/or --slo-tpot")


def plan(
    profile: Profile,
    spec: PlanSpec,
    *,
    registry: PolicyRegistry,
    jobs: int = 1,
    progress: Callable[[int], object] | None = None,
) -> PlanResult:
    """Tune, evaluate and rank every deployment at every load factor."""
    check_spec(spec)
    if not spec.policies:
        raise PlanError("at least one policy is needed (--policies)")
    for name in spec.policies:
        registry.get(name)  # unknown names fail before any simulation
    deps = enumerate_deployments(spec.servers, spec.kinds)
    for dep in deps:  # a profile lacking a mode fails here, not in a worker
        try:
            build_deployment(profile, dep, spec.ladder)
        except ProfileError as e:
            raise PlanError(f"{e}: cannot simulate {deployment_label(dep)} (choose --kinds it has)") from None
    cands = {dep: candidates(spec, dep, registry) for dep in deps}
    workloads = {f: scale_workload(spec.workload, f) for f in spec.loads}

    # Phase 1: tune the deployments that have a choice to make.
    tune_keys: list[tuple[float, Deployment]] = []
    tune_tasks: list[Task] = []
    for f in spec.loads:
        for dep in deps:
            if len(cands[dep]) > 1:
                tune_keys.append((f, dep))
                for c in cands[dep]:
                    for s in spec.tuning_seeds:
                        tune_tasks.append(_task(profile, spec, c, dep, workloads[f], s))
    tuned = iter(_run_all(tune_tasks, spec.objective, jobs, progress))
    chosen: dict[tuple[float, Deployment], PolicyChoice] = {}
    for key in tune_keys:
        best: tuple[PolicyChoice, float] | None = None
        for c in cands[key[1]]:
            score = interval([next(tuned)[2] for _ in spec.tuning_seeds]).mean
            if best is None or _better(score, best[1], spec.higher_is_better):
                best = (c, score)
        assert best is not None
        chosen[key] = best[0]

    # Phase 2: evaluate every deployment with its choice on the evaluation seeds.
    eval_keys = [(f, dep) for f in spec.loads for dep in deps]
    eval_tasks = [
        _task(profile, spec, chosen.get(key, cands[key[1]][0]), key[1], workloads[key[0]], s)
        for key in eval_keys
        for s in spec.seeds
    ]
    evaluated = iter(_run_all(eval_tasks, spec.objective, jobs, progress))
    entries: dict[float, list[Entry]] = {f: [] for f in spec.loads}
    for f, dep in eval_keys:
        rows = [next(evaluated) for _ in spec.seeds]
        entries[f].append(
            Entry(
                deployment=dep,
                order=deps.index(dep),
                choice=chosen.get((f, dep), cands[dep][0]),
                tuned_points=len(cands[dep]) if len(cands[dep]) > 1 else 0,
                scores=tuple(r[2] for r in rows),
                summaries=tuple(r[0] for r in rows),
                goodputs=tuple(r[1] for r in rows),
            )
        )
    loads = [_rank(f, workloads[f], entries[f], spec) for f in spec.loads]
    return PlanResult(spec, loads, len(tune_tasks) + len(eval_tasks))


def _rank(factor: float, workload: WorkloadSpec, entries: list[Entry], spec: PlanSpec) -> LoadResult:
    sign = -1.0 if spec.higher_is_better else 1.0

    def margin(better: Entry, worse: Entry) -> Margin:
        return paired_margin(
            better.scores, worse.scores, higher_is_better=spec.higher_is_better, tie_within=spec.tie_within
        )

    def key(e: Entry) -> tuple[bool, float, int]:
        m = e.score.mean
        return (math.isnan(m), 0.0 if math.isnan(m) else sign * m, e.order)

    ordered = sorted(entries, key=key)
    ranking = [
        Ranked(e, margin(e, ordered[i + 1]) if i + 1 < len(ordered) else None) for i, e in enumerate(ordered)
    ]
    best = ordered[0]
    tied = [e.label for e in ordered[1:] if margin(best, e).verdict == "tie"]
    return LoadResult(factor, workload, ranking, tied)
