"""`specroute plan`: rank every deployment of N servers on a simulated workload, write the winner's config."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from tqdm import tqdm

from controller.cli.args import (
    CommandError,
    check_writable,
    non_negative_int,
    number,
    positive_float,
    positive_int,
    require,
)
from controller.cli.workload_args import (
    SIMULATION_ERRORS,
    add_ladder_arg,
    add_workload_args,
    describe_workload,
    full_batch_ttft_s,
    ladder_from_args,
    offered_tok_s,
    profile_ref,
    skip_note,
    swamp_warning,
    workload_from_args,
)
from policies import together
from policies.params import parse_assignments, split_policy_ref
from policies.profile import Profile, resolve_profile
from policies.registry import default_registry
from simulator import native
from simulator.engine.deployment import SERVER_KINDS, ServerKind
from simulator.engine.results import Slo
from simulator.engine.workloads import generate
from simulator.planning.config import config_text
from simulator.planning.plan import (
    DEFAULT_LOADS,
    DEFAULT_POLICIES,
    DEFAULT_SEEDS,
    DEFAULT_TIE_WITHIN,
    PlanError,
    PlanResult,
    PlanSpec,
    check_spec,
    count_simulations,
    plan,
)
from simulator.planning.report import format_plan, plan_json, policy_label, write_report
from simulator.planning.tuner import OBJECTIVES, parse_grid, write_config


def configure_plan(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Simulate every deployment of N servers over the kinds given (mixed ones with "
        "their routing policies tuned), rank them with confidence intervals across seeds, at "
        "several loads, and write a `specroute serve` config for the winner."
    )
    p.add_argument("--profile", required=True, help="Speed profile: a JSON file or a built-in name.")
    p.add_argument("--servers", type=positive_int, required=True, metavar="N", help="Servers to deploy.")
    p.add_argument(
        "--kinds",
        default="baseline,eagle,adaptive",
        help="Server kinds to consider (default baseline,eagle,adaptive; adaptive only as "
        "an all-adaptive deployment).",
    )
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="mean_e2e_s",
        help="What to optimise: latencies are minimised, throughput (total tok/s) and goodput "
        "(requests/s meeting the SLOs) maximised (default mean_e2e_s).",
    )
    p.add_argument("--slo-ttft", type=positive_float, help="TTFT SLO in seconds (goodput).")
    p.add_argument("--slo-tpot", type=positive_float, help="Time-per-output-token SLO in seconds (goodput).")
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
        type=non_negative_int,
        nargs="+",
        default=list(DEFAULT_SEEDS),
        metavar="S",
        help="Evaluation seeds (default 0 1 2); tuning uses 1000000+S.",
    )
    p.add_argument(
        "--loads",
        type=number,
        nargs="+",
        default=list(DEFAULT_LOADS),
        metavar="X",
        help="Load factors (default 0.5 1 1.5; 1 is always included): sweep concurrency levels, "
        "poisson/bursty rate x X, a trace replayed X times as fast. Policies are re-tuned per load.",
    )
    p.add_argument(
        "--tie-within",
        type=number,
        default=100 * DEFAULT_TIE_WITHIN,
        metavar="PCT",
        help="Margins below this percentage of the objective are ties, whatever the seeds say (default 1).",
    )
    add_ladder_arg(p)
    p.add_argument(
        "--jobs", type=positive_int, default=os.cpu_count() or 1, help="Worker processes (default: CPUs)."
    )
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
    add_workload_args(p, title="workload (as for specroute simulate)", steady_level_defaults=True)
    p.set_defaults(func=_main)


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
    """`POLICY:KEY=...` items grouped by policy (POLICY may be module.path:Class)."""
    out: dict[str, list[str]] = {}
    for item in items:
        policy, rest = split_policy_ref(item)
        if rest is None or not policy:
            raise PlanError(f"{flag} {item!r}: expected POLICY:KEY=VALUE...")
        out.setdefault(policy, []).append(rest)
    return out


def _spec(args: argparse.Namespace) -> PlanSpec:
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    grids = {pol: parse_grid(items) for pol, items in _per_policy(args.grid, "--grid").items()}
    base = {
        pol: parse_assignments(items, "--policy-param")
        for pol, items in _per_policy(args.policy_param, "--policy-param").items()
    }
    stray = sorted((set(grids) | set(base)) - set(policies))
    if stray:
        raise PlanError(f"--grid/--policy-param for {', '.join(stray)}, which is not in --policies")
    loads = sorted({float(x) for x in args.loads} | {1.0})
    return PlanSpec(
        servers=args.servers,
        kinds=_kinds(args.kinds),
        workload=workload_from_args(args, max_load=max(loads)),
        objective=args.objective,
        policies=policies,
        grids=grids,
        base_params=base,
        slo=Slo(args.slo_ttft, args.slo_tpot),
        seeds=tuple(args.seeds),
        loads=tuple(loads),
        tie_within=args.tie_within / 100.0,
        ladder=ladder_from_args(args),
    )


def _describe(spec: PlanSpec, profile: Profile) -> str:
    w = spec.workload
    sweep = (
        f"sweep, levels {' '.join(map(str, w.levels))}, {w.requests_per_level} measured requests/level "
        f"after {w.warmup} warm-up"
    )
    line = (
        f"profile {profile.name!r}; {spec.servers} servers over {', '.join(spec.kinds)}; "
        f"{describe_workload(w, sweep)}"
    )
    colocation = together.describe(profile)
    return line if colocation is None else f"{line}\n{colocation}"


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


def _warn_swamped(result: PlanResult, profile: Profile) -> None:
    """`simulate`'s overload warning, per load factor: the first deployment (in ranking order)
    whose figures, averaged over the seeds, show a swamped deployment, and how many others do."""
    full_batch = full_batch_ttft_s(profile)
    for lr in result.loads:
        offered = offered_tok_s(generate(lr.workload, result.spec.seeds[0]))
        warnings = []
        for r in lr.ranking:
            e = r.entry
            summary = {k: e.mean(k) for k in ("throughput_tok_s", "mean_ttft_s", "p99_ttft_s")}
            label = f"at {lr.factor:g}x load, {policy_label(e)} on {e.label}"
            w = swamp_warning(offered, label, summary, full_batch)
            if w is not None:
                warnings.append(w)
        if warnings:
            others = len(warnings) - 1
            more = (
                f" (and {others} other deployment{'s' * (others != 1)} at this load likewise)"
                if others
                else ""
            )
            print(f"specroute plan: warning: {warnings[0]}{more if others else ''}", file=sys.stderr)


def identical_seeds_note(result: PlanResult) -> str | None:
    """A note when every deployment scored the same on every seed (and there are several): the
    workload drew nothing from the seed, so the intervals are zero-width, not narrow."""
    seeds = result.spec.seeds
    if len(seeds) < 2:
        return None
    for lr in result.loads:
        for r in lr.ranking:
            scores = r.entry.scores
            if max(scores) - min(scores) > 1e-9 * max(abs(v) for v in scores):
                return None
    return (
        f"every deployment scored the same on each of the {len(seeds)} seeds: this workload draws nothing "
        "from the seed (a trace replay takes its arrivals and lengths from the file), so each figure is one "
        f"simulation's and has no interval; margins under {100 * result.spec.tie_within:g}% are ties, larger "
        "ones are the simulation's exact differences"
    )


def _main(args: argparse.Namespace) -> int:
    check_writable(args.out)
    try:
        if args.report:
            require("matplotlib", "plot", "--report")
        profile = resolve_profile(args.profile)
        spec = _spec(args)
        check_spec(spec)  # before the progress bar appears
        generate(spec.workload, spec.seeds[0])  # a bad trace fails here, before any worker starts
        _warn_transient(spec)
        registry = default_registry()
        total = count_simulations(spec, registry)
        with tqdm(
            total=total,
            desc="simulations",
            unit="run",
            file=sys.stderr,
            disable=args.no_progress or not sys.stderr.isatty(),  # a log gets no bar
        ) as bar:
            result = plan(profile, spec, registry=registry, jobs=args.jobs, progress=bar.update)
        command = "specroute " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["plan"] else "specroute plan"
        write_config(
            args.out,
            config_text(
                result,
                profile,
                profile_ref(args.profile),
                command=command,
                model_path=args.model_path,
                draft_model_path=args.draft_model_path,
            ),
        )
        _warn_swamped(result, profile)
        description = _describe(spec, profile)
        identical = identical_seeds_note(result)
        if args.json:
            skipped = skip_note(spec.workload)
            if skipped is not None:
                print(f"note: trace {spec.workload.trace}: {skipped}", file=sys.stderr)
            if identical is not None:
                print(f"note: {identical}", file=sys.stderr)
            doc = plan_json(result, args.out)
            colocation = together.to_json(profile)
            if colocation is not None:
                doc["colocation"] = colocation
                print(f"note: {together.describe(profile)}", file=sys.stderr)
            print(json.dumps(doc, indent=2))
        else:
            print(format_plan(result, description + native.describe()))
            if identical is not None:
                print(f"\nnote: {identical}")
            print(f"\nconfig for {result.reference.best.label} written to {args.out}")
        if args.report:
            report = write_report(result, args.report, description=description, config_path=args.out)
            print(f"report written to {report}", file=sys.stderr)
    except (PlanError, *SIMULATION_ERRORS) as e:
        raise CommandError(e) from None
    return 0
