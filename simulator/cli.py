"""`specroute simulate` and `specroute tune`: the offline simulator's command line."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

from tqdm import tqdm

from policies.profile import Profile, resolve_profile
from policies.registry import default_registry
from simulator.cli_args import (
    SIMULATION_ERRORS,
    add_workload_args,
    buckets_from_args,
    describe_workload,
    profile_ref,
    workload_from_args,
)
from simulator.report import align_columns, format_table, write_report
from simulator.results import RunResult, Slo
from simulator.runner import PolicyChoice, is_single_pool, run
from simulator.servers import ServerKind, parse_deployment
from simulator.tuner import OBJECTIVES, config_text, parse_grid, tune, valid_points, write_config
from simulator.workloads import WorkloadSpec, generate


class CliError(ValueError):
    """A command-line value that cannot be used."""


def _value(text: str) -> Any:
    """A parameter value: JSON when it parses (numbers, booleans, lists, objects), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_key_values(items: list[str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"{what} {item!r}: expected KEY=VALUE")
        out[key.strip()] = _value(value.strip())
    return out


def parse_policy(text: str, default_params: dict[str, Any]) -> PolicyChoice:
    """`NAME` or `NAME:KEY=VALUE,...` (NAME may itself be `module.path:ClassName`)."""
    head, sep, tail = text.rpartition(":")
    if sep and "=" in tail:
        return PolicyChoice(head, parse_key_values(tail.split(","), f"--policy {text!r}:"))
    return PolicyChoice(text, dict(default_params))


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="Speed profile: a JSON file or a built-in name.")
    p.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Policy parameter (JSON values accepted); applies to every --policy without inline params.",
    )
    add_workload_args(p)
    d = p.add_argument_group("deployment")
    d.add_argument(
        "--deployment",
        action="append",
        metavar="KIND=N,...",
        help="Servers per kind (baseline, eagle, adaptive); default baseline=1,eagle=1. Repeat to compare.",
    )
    d.add_argument(
        "--adaptive-buckets",
        metavar="LIMIT:DEPTH,...",
        help="Adaptive server: speculation depth (0..1) below each batch size; 0 beyond the last "
        "(default 8:1,32:0.667,64:0.333).",
    )
    p.add_argument("--seed", type=int, default=0, help="Random seed of the workload and the run (default 0).")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser(
        "simulate",
        help="Replay a workload through simulated servers and policies.",
        description="Discrete-event simulation of policies routing between simulated baseline "
        "and EAGLE servers whose speed follows a profile.",
    )
    _add_common(s)
    s.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME[:KEY=VALUE,...]",
        help="Policy to simulate; repeat to compare side by side (default threshold).",
    )
    s.add_argument("--json", action="store_true", help="Print one JSON document.")
    s.add_argument("--report", metavar="DIR", help="Write a markdown report and PNG plots into DIR.")
    s.set_defaults(func=_simulate_main)

    t = sub.add_parser(
        "tune",
        help="Grid-search a policy's parameters on a simulated workload.",
        description="Simulate every grid point, rank them, and write the best as a serve config.",
    )
    _add_common(t)
    t.add_argument(
        "--policy", required=True, metavar="NAME", help="Policy to tune (a built-in name or module:Class)."
    )
    t.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        required=True,
        help="Values to try for a policy parameter (repeat for more keys: every combination is run).",
    )
    t.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="mean_e2e_s",
        help="What to optimise: latencies are minimised, goodput (requests/s meeting the SLOs) "
        "maximised (default mean_e2e_s).",
    )
    t.add_argument("--slo-ttft", type=float, help="TTFT SLO in seconds (goodput).")
    t.add_argument("--slo-tpot", type=float, help="Time-per-output-token SLO in seconds (goodput).")
    t.add_argument("--out", required=True, metavar="FILE", help="Config file to write (YAML).")
    t.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="Worker processes (default: CPUs).")
    t.set_defaults(func=_tune_main)


def _deployments(args: argparse.Namespace) -> list[tuple[tuple[ServerKind, int], ...]]:
    return [parse_deployment(d) for d in (args.deployment or ["baseline=1,eagle=1"])]


def _describe(spec: WorkloadSpec, profile: Profile) -> str:
    levels = " ".join(map(str, spec.levels))
    sweep = f"sweep, levels {levels}, {spec.requests_per_level} requests/level + {spec.warmup} warm-up"
    return f"profile {profile.name!r}; {describe_workload(spec, sweep)}"


def _fail(command: str, e: Exception) -> int:
    print(f"specroute {command}: error: {e}", file=sys.stderr)
    return 2


def _simulate_main(args: argparse.Namespace) -> int:
    try:
        profile = resolve_profile(args.profile)
        spec = workload_from_args(args)
        deployments = _deployments(args)
        buckets = buckets_from_args(args)
        base_params = parse_key_values(args.policy_param, "--policy-param")
        choices = [parse_policy(p, base_params) for p in (args.policy or ["threshold"])]
        registry = default_registry()
        for c in choices:  # validate every policy before the first simulation
            registry.parse_params(c.name, c.params)
        segments = generate(spec, args.seed)
        runs: list[RunResult] = []
        for dep in deployments:
            for c in choices[:1] if is_single_pool(dep) else choices:
                runs.append(
                    run(profile, c, dep, segments, seed=args.seed, buckets=buckets, registry=registry)
                )
        if args.json:
            print(json.dumps({"runs": [r.to_json() for r in runs]}, indent=2))
        else:
            print(_describe(spec, profile))
            print(format_table(runs))
        if args.report:
            path = write_report(
                runs, args.report, title="specroute simulation", description=_describe(spec, profile)
            )
            print(f"report written to {path}", file=sys.stderr)
    except (*SIMULATION_ERRORS, CliError) as e:
        return _fail("simulate", e)
    return 0


def _tune_main(args: argparse.Namespace) -> int:
    try:
        profile = resolve_profile(args.profile)
        spec = workload_from_args(args)
        deployments = _deployments(args)
        if len(deployments) != 1:
            raise CliError("tune takes one --deployment")
        if args.jobs < 1:
            raise CliError("--jobs must be >= 1")
        if args.objective == "goodput" and args.slo_ttft is None and args.slo_tpot is None:
            raise CliError("--objective goodput needs --slo-ttft and/or --slo-tpot")
        for name, v in (("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot)):
            if v is not None and v <= 0:
                raise CliError(f"{name} must be > 0")
        if "=" in args.policy.rpartition(":")[2]:
            raise CliError("tune: give parameters with --policy-param / --grid, not NAME:KEY=VALUE")
        base_params = parse_key_values(args.policy_param, "--policy-param")
        grid = parse_grid(args.grid)
        registry = default_registry()
        points, _, rejected = valid_points(registry, args.policy, base_params, grid)  # before the bar
        total = len(points) + len(rejected)
        skipped: list[tuple[dict[str, Any], str]] = []
        with tqdm(total=total, desc="grid points", unit="pt", file=sys.stderr) as bar:
            ranking = tune(
                profile,
                args.policy,
                base_params,
                grid,
                deployments[0],
                spec,
                args.objective,
                registry=registry,
                slo=Slo(args.slo_ttft, args.slo_tpot),
                seed=args.seed,
                jobs=args.jobs,
                buckets=buckets_from_args(args),
                progress=bar.update,
                on_skip=lambda point, reason: skipped.append((point, reason)),
            )
        for point, reason in skipped:
            shown = ",".join(f"{k}={point[k]}" for k, _ in grid)
            print(f"warning: grid point {shown} skipped: {reason}", file=sys.stderr)
        print(_describe(spec, profile))
        print(
            f"objective: {args.objective} "
            + (
                "(requests/s meeting every SLO given; higher is better)"
                if args.objective == "goodput"
                else "(seconds; lower is better)"
            )
        )
        columns = [c for c in ("mean_e2e_s", "p99_ttft_s", "p99_e2e_s") if c != args.objective]
        header = ["rank", "params", args.objective, *columns, "eagle %"]
        rows = []
        for i, r in enumerate(ranking, 1):
            s = r.summary
            rows.append(
                [
                    str(i),
                    ",".join(f"{k}={json.dumps(v)}" for k, v in r.params.items() if k in dict(grid)) or "-",
                    f"{r.score:.4f}",
                    *(f"{s[c]:.4f}" if s[c] is not None else "-" for c in columns),
                    f"{100 * s['pool_share']['eagle']:.0f}",
                ]
            )
        print(align_columns(header, rows, left={1}))
        best = ranking[0]
        text = config_text(
            args.policy,
            best.params,
            profile_ref(args.profile),
            objective=args.objective,
            best=best,
            command="specroute " + shlex.join(sys.argv[1:]),
        )
        write_config(args.out, text)
        print(f"best: {args.policy} {json.dumps(best.params)} -> {args.out}")
    except (*SIMULATION_ERRORS, CliError) as e:
        return _fail("tune", e)
    return 0
