"""`specroute plan`: rank every deployment of N servers on a simulated workload, write the winner's config."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from policies.profile import ProfileError, resolve_profile
from policies.registry import PolicyError, default_registry
from simulator.engine import SimulationError
from simulator.plan import (
    DEFAULT_LOADS,
    DEFAULT_POLICIES,
    DEFAULT_SEEDS,
    DEFAULT_TIE_WITHIN,
    PlanError,
    PlanSpec,
    count_simulations,
    plan,
)
from simulator.plan_config import config_text
from simulator.plan_report import format_plan, plan_json, write_report
from simulator.report import ReportError
from simulator.results import Slo
from simulator.servers import (
    DEFAULT_ADAPTIVE_BUCKETS,
    SERVER_KINDS,
    DeploymentError,
    ServerKind,
    parse_buckets,
)
from simulator.traces import TRACE_FORMATS, TraceError
from simulator.tuner import OBJECTIVES, TuneError, parse_grid, write_config
from simulator.workloads import (
    DEFAULT_LEVELS,
    WORKLOAD_KINDS,
    AcceptModel,
    LengthSpec,
    WorkloadError,
    WorkloadSpec,
    generate,
)

_ERRORS = (
    PlanError,
    ProfileError,
    PolicyError,
    WorkloadError,
    TraceError,
    DeploymentError,
    TuneError,
    ReportError,
    SimulationError,
)


def _add_workload(p: argparse.ArgumentParser) -> None:
    """The workload flags of `specroute simulate`, with the same names and defaults."""
    w = p.add_argument_group("workload (as for specroute simulate)")
    w.add_argument("--workload", choices=WORKLOAD_KINDS, default="sweep")
    w.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        action="extend",
        metavar="N",
        help=f"Sweep levels (default {' '.join(map(str, DEFAULT_LEVELS))}).",
    )
    w.add_argument(
        "--requests-per-level",
        type=int,
        help="Measured requests per sweep level (default: the highest concurrency planned, at least 30, "
        "so every level is measured in a steady state).",
    )
    w.add_argument(
        "--warmup-requests",
        type=int,
        help="Unmeasured requests per sweep level (default: the highest concurrency planned, at least 5).",
    )
    w.add_argument("--rate", type=float, default=10.0, help="Mean arrival rate (poisson, bursty), req/s.")
    w.add_argument("--requests", type=int, help="Requests (poisson/bursty: default 1000; trace: first N).")
    w.add_argument("--burst-factor", type=float, default=4.0, help="Bursty: high/low state rate.")
    w.add_argument("--burst-period", type=float, default=10.0, help="Bursty: mean seconds per state.")
    w.add_argument("--trace", help="Trace file (Azure LLM inference CSV or specroute decision log).")
    w.add_argument("--trace-format", choices=TRACE_FORMATS, help="Trace format (default: detected).")
    w.add_argument("--time-scale", type=float, default=1.0, help="Multiply trace timestamps by this.")
    w.add_argument("--output-tokens", help="const:N, exp:MEAN, lognormal:MEAN,SIGMA (default const:200).")
    w.add_argument("--prompt-tokens", help="Prompt lengths, same forms (default const:256).")
    w.add_argument("--hint-mix", metavar="HINT=W,...", help="Synthetic hints with weights.")
    w.add_argument("--hint-accept", metavar="HINT=F,...", help="EAGLE speed factor per hint.")
    w.add_argument("--accept-sigma", type=float, default=0.0, help="Spread of each request's EAGLE factor.")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="Which mix of plain, EAGLE-3 and adaptive servers serves a workload best (simulated).",
        description="Simulate every deployment of N servers over the kinds given (mixed ones with "
        "their routing policies tuned), rank them with confidence intervals across seeds, at "
        "several loads, and write a `specroute serve` config for the winner.",
    )
    p.add_argument("--profile", required=True, help="Speed profile: a JSON file or a built-in name.")
    p.add_argument("--servers", type=int, required=True, metavar="N", help="Servers to deploy.")
    p.add_argument(
        "--kinds",
        default="baseline,eagle,adaptive",
        help="Server kinds to consider (default baseline,eagle,adaptive; adaptive only as "
        "an all-adaptive deployment).",
    )
    p.add_argument("--objective", choices=OBJECTIVES, default="mean_e2e_s")
    p.add_argument("--slo-ttft", type=float, help="TTFT SLO in seconds (goodput).")
    p.add_argument("--slo-tpot", type=float, help="Time-per-output-token SLO in seconds (goodput).")
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"Routing policies tuned on mixed deployments (default {','.join(DEFAULT_POLICIES)}).",
    )
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="POLICY:KEY=V1,V2,...",
        help="Replace a policy's default grid (repeat for more keys).",
    )
    p.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="POLICY:KEY=VALUE",
        help="Fixed parameter of a policy, applied to all its grid points.",
    )
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=list(DEFAULT_SEEDS),
        metavar="S",
        help="Evaluation seeds (default 0 1 2); tuning uses 1000000+S.",
    )
    p.add_argument(
        "--loads",
        type=float,
        nargs="+",
        default=list(DEFAULT_LOADS),
        metavar="X",
        help="Load factors (default 0.5 1 1.5; 1 is always included): sweep concurrency levels, "
        "poisson/bursty rate x X, a trace replayed X times as fast. Policies are re-tuned per load.",
    )
    p.add_argument(
        "--tie-within",
        type=float,
        default=100 * DEFAULT_TIE_WITHIN,
        metavar="PCT",
        help="Margins below this percentage of the objective are ties, whatever the seeds say (default 1).",
    )
    p.add_argument("--adaptive-buckets", metavar="LIMIT:DEPTH,...", help="Adaptive server's depth buckets.")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="Worker processes (default: CPUs).")
    p.add_argument(
        "--out",
        default="specroute-plan.yaml",
        metavar="FILE",
        help="Config file written for the winner (default specroute-plan.yaml).",
    )
    p.add_argument(
        "--model-path", default="MODEL_PATH", help="Model path written in the SGLang launch lines."
    )
    p.add_argument(
        "--draft-model-path",
        default="EAGLE3_DRAFT_MODEL_PATH",
        help="EAGLE-3 draft model path written in the launch lines.",
    )
    p.add_argument("--json", action="store_true", help="Print one JSON document instead of tables.")
    p.add_argument("--report", metavar="DIR", help="Write a markdown report and a PNG plot into DIR.")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")
    _add_workload(p)
    p.set_defaults(func=_main)


def _weights(text: str | None, what: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in (text or "").split(",") if text else []:
        key, sep, value = item.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            out[key.strip()] = float(value)
        except ValueError:
            raise PlanError(f"{what} {item!r}: expected NAME=NUMBER[,NAME=NUMBER...]") from None
        if out[key.strip()] < 0:
            raise PlanError(f"{what} {item!r}: must be >= 0")
    return out


def _workload(args: argparse.Namespace, loads: list[float]) -> WorkloadSpec:
    levels = tuple(args.concurrency) if args.concurrency else DEFAULT_LEVELS
    # Steady state: with fewer measured (or warm-up) requests than clients, a level measures the
    # first requests after warm-up, which a policy keeping one pool nearly empty passes quickly.
    top = max(1, round(max(levels) * max(loads)))
    if args.accept_sigma < 0:
        raise PlanError("--accept-sigma must be >= 0")
    hint_accept = _weights(args.hint_accept, "--hint-accept")
    if any(v <= 0 for v in hint_accept.values()):
        raise PlanError("--hint-accept factors must be > 0")
    return WorkloadSpec(
        kind=args.workload,
        levels=levels,
        requests_per_level=args.requests_per_level if args.requests_per_level is not None else max(30, top),
        warmup=args.warmup_requests if args.warmup_requests is not None else max(5, top),
        rate=args.rate,
        requests=args.requests,
        burst_factor=args.burst_factor,
        burst_period_s=args.burst_period,
        trace=args.trace,
        trace_format=args.trace_format,
        time_scale=args.time_scale,
        output_tokens=LengthSpec.parse(args.output_tokens) if args.output_tokens else None,
        prompt_tokens=LengthSpec.parse(args.prompt_tokens) if args.prompt_tokens else None,
        hint_mix=_weights(args.hint_mix, "--hint-mix"),
        accept=AcceptModel(args.accept_sigma, hint_accept),
    )


def _kinds(text: str) -> tuple[ServerKind, ...]:
    out: list[ServerKind] = []
    for part in text.split(","):
        k = part.strip()
        if k not in SERVER_KINDS:
            raise PlanError(f"--kinds: unknown server kind {k!r} (known: {', '.join(SERVER_KINDS)})")
        kind: ServerKind = "baseline" if k == "baseline" else "eagle" if k == "eagle" else "adaptive"
        if kind not in out:
            out.append(kind)
    return tuple(out)


def _per_policy(items: list[str], flag: str) -> dict[str, list[str]]:
    """`POLICY:REST` items grouped by policy (POLICY may be module.path:Class)."""
    out: dict[str, list[str]] = {}
    for item in items:
        policy, sep, rest = item.rpartition(":")
        if not sep or not policy.strip() or "=" not in rest:
            raise PlanError(f"{flag} {item!r}: expected POLICY:KEY=VALUE...")
        out.setdefault(policy.strip(), []).append(rest)
    return out


def _param_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _spec(args: argparse.Namespace) -> PlanSpec:
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    grids = {pol: parse_grid(items) for pol, items in _per_policy(args.grid, "--grid").items()}
    base: dict[str, dict[str, Any]] = {}
    for pol, items in _per_policy(args.policy_param, "--policy-param").items():
        for item in items:
            key, _, value = item.partition("=")
            base.setdefault(pol, {})[key.strip()] = _param_value(value.strip())
    stray = sorted((set(grids) | set(base)) - set(policies))
    if stray:
        raise PlanError(f"--grid/--policy-param for {', '.join(stray)}, which is not in --policies")
    for name, v in (("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot)):
        if v is not None and v <= 0:
            raise PlanError(f"{name} must be > 0")
    loads = sorted({float(x) for x in args.loads} | {1.0})
    return PlanSpec(
        servers=args.servers,
        kinds=_kinds(args.kinds),
        workload=_workload(args, loads),
        objective=args.objective,
        policies=policies,
        grids=grids,
        base_params=base,
        slo=Slo(args.slo_ttft, args.slo_tpot),
        seeds=tuple(args.seeds),
        loads=tuple(loads),
        tie_within=args.tie_within / 100.0,
        buckets=parse_buckets(args.adaptive_buckets) if args.adaptive_buckets else DEFAULT_ADAPTIVE_BUCKETS,
    )


def _describe(spec: PlanSpec, profile_name: str) -> str:
    w = spec.workload
    if w.kind == "sweep":
        what = (
            f"sweep, levels {' '.join(map(str, w.levels))}, {w.requests_per_level} measured requests/level "
            f"after {w.warmup} warm-up"
        )
    elif w.kind == "trace":
        what = f"trace {w.trace} (time scale {w.time_scale:g})"
    else:
        what = f"{w.kind}, rate {w.rate:g}/s"
    out = str(w.output_tokens) if w.output_tokens else ("trace" if w.kind == "trace" else "const:200")
    return (
        f"profile {profile_name!r}; {spec.servers} servers over {', '.join(spec.kinds)}; "
        f"workload: {what}; output tokens {out}"
    )


def _warn_transient(spec: PlanSpec) -> None:
    """Sweep levels with more clients than measured requests measure a start-up window."""
    w = spec.workload
    if w.kind != "sweep":
        return
    top = max(spec.loads)
    short = sorted({c for c in w.levels if round(c * top) > w.requests_per_level})
    if short:
        print(
            f"specroute plan: note: at concurrency {', '.join(map(str, short))} (up to x{top:g}) there are "
            f"more clients than measured requests ({w.requests_per_level}): those levels measure the "
            "first requests after warm-up, which a policy keeping one pool nearly empty passes "
            "quickly; for a steady state give --requests-per-level (and --warmup-requests) of at "
            "least the concurrency.",
            file=sys.stderr,
        )


def _main(args: argparse.Namespace) -> int:
    try:
        profile = resolve_profile(args.profile)
        spec = _spec(args)
        if args.jobs < 1:
            raise PlanError("--jobs must be >= 1")
        generate(spec.workload, spec.seeds[0])  # a bad trace fails here, before any worker starts
        _warn_transient(spec)
        registry = default_registry()
        total = count_simulations(spec, registry)
        with tqdm(
            total=total, desc="simulations", unit="run", file=sys.stderr, disable=args.no_progress
        ) as bar:
            result = plan(profile, spec, registry=registry, jobs=args.jobs, progress=bar.update)
        path = Path(args.profile)
        profile_ref = str(path.resolve()) if path.is_file() else args.profile
        command = "specroute " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["plan"] else "specroute plan"
        write_config(
            args.out,
            config_text(
                result,
                profile,
                profile_ref,
                command=command,
                model_path=args.model_path,
                draft_model_path=args.draft_model_path,
            ),
        )
        description = _describe(spec, profile.name)
        if args.json:
            print(json.dumps(plan_json(result, args.out), indent=2))
        else:
            print(format_plan(result, description))
            print(f"\nconfig for {result.reference.best.label} written to {args.out}")
        if args.report:
            report = write_report(result, args.report, description=description, config_path=args.out)
            print(f"report written to {report}", file=sys.stderr)
    except _ERRORS as e:
        print(f"specroute plan: error: {e}", file=sys.stderr)
        return 2
    return 0
