"""`specroute simulate` and `specroute tune`: the offline simulator's command line."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from typing import Any

from tqdm import tqdm

from controller.cli.args import (
    CommandError,
    check_writable,
    non_negative_float,
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
    deployment_text,
    describe_workload,
    full_batch_ttft_s,
    ladder_from_args,
    offered_tok_s,
    profile_ref,
    skip_note,
    swamp_warning,
    transient_warning,
    uniform_accept_note,
    workload_from_args,
)
from policies import together
from policies.params import parse_assignments, parse_policy_ref, split_policy_ref
from policies.profile import Profile, resolve_profile
from policies.registry import default_registry
from simulator import native
from simulator.engine.deployment import ServerKind, parse_deployment, parse_speed, server_profile
from simulator.engine.replica_views import SPLITS, RouterSetup
from simulator.engine.report import align_columns, format_table, write_report
from simulator.engine.results import RunResult, Slo
from simulator.engine.runner import PolicyChoice, is_single_pool, run
from simulator.engine.workloads import WorkloadSpec, generate
from simulator.planning.tuner import (
    DEFAULT_SEEDS,
    DEFAULT_TIE_WITHIN,
    OBJECTIVE_UNITS,
    OBJECTIVES,
    PointResult,
    TuneResult,
    config_text,
    parse_grid,
    tune,
    valid_points,
    write_config,
)


def parse_policy(text: str, default_params: dict[str, Any]) -> PolicyChoice:
    """`NAME` or `NAME:KEY=VALUE,...` (the `policies.params` grammar); without inline parameters
    the policy gets `default_params` (the --policy-param values)."""
    name, params = parse_policy_ref(text)
    return PolicyChoice(name, dict(default_params) if params is None else params)


def _add_common(p: argparse.ArgumentParser, steady_per_client: str) -> None:
    p.add_argument(
        "--profile",
        required=True,
        help="Speed profile the policies believe: a JSON file or a built-in name (also the servers' "
        "speed unless --server-profile/--server-speed say otherwise).",
    )
    p.add_argument(
        "--server-profile",
        action="append",
        default=[],
        metavar="FILE|NAME",
        help="Speed profile the simulated servers run from (the truth), while the policies keep "
        "--profile: one two-mode profile, or one per mode (repeat); modes it lacks come from --profile.",
    )
    p.add_argument(
        "--server-speed",
        action="append",
        default=[],
        metavar="MODE=FACTOR",
        help="Make a mode's simulated servers FACTOR times as fast as their profile says (decode and "
        "prefill rates x FACTOR, TTFT / FACTOR), e.g. eagle=0.8; the policies are not told.",
    )
    p.add_argument(
        "--spec-details",
        action="store_true",
        help="Outcomes of eagle requests carry their accept length, as SGLang reports it with "
        "return_spec_tokens_details (serve's spec_details setting); calibrating policies use it.",
    )
    p.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Policy parameter (VALUE is JSON when it parses, else text); applies to every --policy "
        "without inline params.",
    )
    add_workload_args(p, steady_per_client=steady_per_client)
    d = p.add_argument_group("deployment")
    d.add_argument(
        "--deployment",
        action="append",
        metavar="KIND=N,...",
        help="Servers per kind (baseline, eagle, adaptive); default baseline=1,eagle=1. Repeat to compare.",
    )
    d.add_argument(
        "--cache-tokens",
        type=non_negative_int,
        metavar="N",
        help="Prefix-cache capacity of every simulated server in tokens (and what the router's prefix "
        "index assumes), instead of the profiles' cache_tokens; 0: no cache. Matters for workloads "
        "with prompt blocks (multiturn, Mooncake traces).",
    )
    add_ladder_arg(d)


def configure_simulate(s: argparse.ArgumentParser) -> None:
    s.description = (
        "Discrete-event simulation of policies routing between simulated baseline "
        "and EAGLE servers whose speed follows a profile."
    )
    _add_common(s, "with --oracle")
    s.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="Random seed of the workload and the run (default 0).",
    )
    s.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME[:KEY=VALUE,...]",
        help="Policy to simulate; repeat to compare side by side (default threshold).",
    )
    s.add_argument(
        "--oracle",
        action="store_true",
        help="Sweeps: per level, the best static split (k clients on eagle, the rest on baseline) "
        "computed from the servers' profile, and each policy's throughput ratio to it.",
    )
    r = s.add_argument_group("replicas")
    r.add_argument(
        "--routers",
        type=positive_int,
        default=1,
        help="specroute replicas in front of the servers, each with its own policy and its own scraped "
        "view of the load (default 1).",
    )
    r.add_argument(
        "--scrape-interval",
        type=non_negative_float,
        metavar="S",
        help="Seconds between a router's scrapes of the servers (each router at its own phase); 0: every "
        "router sees the true load at every decision. Default: 0 (the perfect view) with --routers 1, "
        "else 1 (serve's scrape_interval_s).",
    )
    r.add_argument(
        "--router-split",
        choices=SPLITS,
        default="random",
        help="How arrivals are spread over the routers: random (kube-proxy iptables mode, the default) "
        "or round-robin (IPVS).",
    )
    r.add_argument(
        "--replicas-setting",
        type=positive_int,
        default=1,
        metavar="N",
        help="serve's `replicas` setting given to every router: its own traffic since a scrape counts N "
        "times (default 1: off).",
    )
    s.add_argument("--json", action="store_true", help="Print one JSON document.")
    s.add_argument("--report", metavar="DIR", help="Write a markdown report and PNG plots into DIR.")
    s.set_defaults(func=_simulate_main)


def configure_tune(t: argparse.ArgumentParser) -> None:
    t.description = "Simulate every grid point, rank them, and write the best as a serve config."
    _add_common(t, "always")
    t.add_argument(
        "--seeds",
        "--seed",
        type=non_negative_int,
        nargs="+",
        default=list(DEFAULT_SEEDS),
        metavar="S",
        help=f"Seeds every grid point runs on (default {' '.join(map(str, DEFAULT_SEEDS))}): a point's "
        "score is its mean over them with a 95%% interval, and margins are paired over them.",
    )
    t.add_argument(
        "--tie-within",
        type=number,
        default=100 * DEFAULT_TIE_WITHIN,
        metavar="PCT",
        help="Margins below this percentage of the objective are ties, whatever the seeds say (default 1), "
        "as in `specroute plan`.",
    )
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
        help="What to optimise: latencies are minimised, throughput (total tok/s) and goodput "
        "(requests/s meeting the SLOs) maximised (default: throughput_tok_s for a sweep, else mean_e2e_s).",
    )
    t.add_argument("--slo-ttft", type=positive_float, help="TTFT SLO in seconds (goodput).")
    t.add_argument("--slo-tpot", type=positive_float, help="Time-per-output-token SLO in seconds (goodput).")
    t.add_argument("--out", required=True, metavar="FILE", help="Config file to write (YAML).")
    t.add_argument(
        "--jobs", type=positive_int, default=os.cpu_count() or 1, help="Worker processes (default: CPUs)."
    )
    t.set_defaults(func=_tune_main)


def _deployments(args: argparse.Namespace) -> list[tuple[tuple[ServerKind, int], ...]]:
    return [parse_deployment(d) for d in (args.deployment or ["baseline=1,eagle=1"])]


def _describe(spec: WorkloadSpec, profile: Profile, servers: Profile) -> str:
    levels = " ".join(map(str, spec.levels))
    if spec.measure_per_client or spec.warmup_per_client:
        sizes = (
            f"max({spec.requests_per_level}, {spec.measure_per_client} x clients) requests/level + "
            f"max({spec.warmup}, {spec.warmup_per_client} x clients) warm-up"
        )
    else:
        sizes = f"{spec.requests_per_level} requests/level + {spec.warmup} warm-up"
    truth = f"; servers run from {servers.name!r}" if servers is not profile else ""
    line = f"profile {profile.name!r}{truth}; {describe_workload(spec, f'sweep, levels {levels}, {sizes}')}"
    colocation = together.describe(servers)
    return line if colocation is None else f"{line}\n{colocation}"


def _servers(args: argparse.Namespace, profile: Profile) -> Profile:
    """The profile the simulated servers run from (--server-profile, --server-speed)."""
    overrides = [resolve_profile(p) for p in args.server_profile]
    return server_profile(profile, overrides, parse_speed(args.server_speed))


def _warn_transient(spec: WorkloadSpec) -> None:
    warning = transient_warning(spec)
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)


def _simulate_main(args: argparse.Namespace) -> int:
    try:
        profile = resolve_profile(args.profile)
        servers = _servers(args, profile)
        spec = workload_from_args(args, steady=args.oracle)
        if args.oracle:
            if spec.kind != "sweep":
                raise CommandError("--oracle needs a closed-loop sweep (--workload sweep)")
            _warn_transient(spec)
        deployments = _deployments(args)
        ladder = ladder_from_args(args)
        if args.report:
            require("matplotlib", "plot", "--report")
        base_params = parse_assignments(args.policy_param)
        choices = [parse_policy(p, base_params) for p in (args.policy or ["threshold"])]
        registry = default_registry()
        for c in choices:  # validate every policy before the first simulation
            registry.parse_params(c.name, c.params)
        interval = args.scrape_interval
        if interval is None:
            interval = 0.0 if args.routers == 1 else 1.0
        routers = RouterSetup(args.routers, interval, args.router_split, float(args.replicas_setting))
        segments = generate(spec, args.seed)
        uniform = uniform_accept_note(spec, segments)
        if uniform is not None:
            print(f"note: {uniform}", file=sys.stderr)
        runs: list[RunResult] = []
        for dep in deployments:
            for c in choices[:1] if is_single_pool(dep) else choices:
                runs.append(
                    run(
                        profile,
                        c,
                        dep,
                        segments,
                        seed=args.seed,
                        ladder=ladder,
                        registry=registry,
                        server_profile=servers,
                        oracle=args.oracle,
                        spec_details=args.spec_details,
                        cache_tokens=args.cache_tokens,
                        routers=routers,
                    )
                )
        description = _describe(spec, profile, servers)
        offered = offered_tok_s(segments)
        for r in runs:
            label = f"{r.policy} on {deployment_text(r.deployment)}"
            swamped = swamp_warning(offered, label, r.summary, full_batch_ttft_s(servers))
            if swamped is not None:
                print(f"warning: {swamped}", file=sys.stderr)
        if args.json:
            skipped = skip_note(spec)
            if skipped is not None:
                print(f"note: trace {spec.trace}: {skipped}", file=sys.stderr)
            doc: dict[str, Any] = {"runs": [r.to_json() for r in runs]}
            if servers is not profile:
                doc["server_profile"] = servers.name
            colocation = together.to_json(servers)
            if colocation is not None:
                doc["colocation"] = colocation
                print(f"note: {together.describe(servers)}", file=sys.stderr)
            print(json.dumps(doc, indent=2))
        else:
            print(description + native.describe())
            print(format_table(runs))
        if args.report:
            path = write_report(runs, args.report, title="specroute simulation", description=description)
            print(f"report written to {path}", file=sys.stderr)
    except SIMULATION_ERRORS as e:
        raise CommandError(e) from None
    return 0


def _pm(v: Any, half: float, identical: bool) -> str:
    if not isinstance(v, int | float) or math.isnan(v):
        return "-"
    return f"{v:.4f}" if identical or math.isnan(half) else f"{v:.4f} ±{half:.2g}"


def _tune_table(result: TuneResult, objective: str, label: Any) -> str:
    """The ranking: the objective's mean over the seeds (± its 95% half-width), the other figures'
    means, the eagle share and the paired margin to the next point."""
    columns = [c for c in ("throughput_tok_s", "mean_e2e_s", "p99_ttft_s", "p99_e2e_s") if c != objective]
    header = ["rank", "params", f"{objective} (95% CI)", *columns, "eagle %", "margin to next (95% CI)"]
    rows = []
    identical = result.identical_seeds
    for i, (r, m) in enumerate(zip(result.ranking, result.margins, strict=True), 1):
        s = r.summary
        score = r.score
        margin = ""
        if m is not None:
            d = m.diff
            exact = math.isnan(d.half) or d.half <= 1e-9 * abs(d.mean)  # one seed, or identical runs
            ci = "" if exact else f" [{d.low:.3g}, {d.high:.3g}]"
            margin = f"{d.mean:.3g}{ci} {m.verdict}"
        rows.append(
            [
                str(i),
                label(r),
                _pm(score.mean, score.half, identical),
                *(f"{s[c]:.4f}" if isinstance(s.get(c), int | float) else "-" for c in columns),
                f"{100 * s['pool_share']['eagle']:.0f}",
                margin,
            ]
        )
    return align_columns(header, rows, left={1, len(header) - 1}, strip=True)


def _tune_main(args: argparse.Namespace) -> int:
    check_writable(args.out)
    try:
        profile = resolve_profile(args.profile)
        servers = _servers(args, profile)
        spec = workload_from_args(args, steady=True)
        _warn_transient(spec)
        deployments = _deployments(args)
        if len(deployments) != 1:
            raise CommandError("tune takes one --deployment")
        if args.objective is None:
            args.objective = "throughput_tok_s" if spec.kind == "sweep" else "mean_e2e_s"
        if args.objective == "goodput" and args.slo_ttft is None and args.slo_tpot is None:
            raise CommandError("--objective goodput needs --slo-ttft and/or --slo-tpot")
        if split_policy_ref(args.policy)[1] is not None:
            raise CommandError("tune: give parameters with --policy-param / --grid, not NAME:KEY=VALUE")
        base_params = parse_assignments(args.policy_param)
        grid = parse_grid(args.grid)
        registry = default_registry()
        points, _, rejected = valid_points(registry, args.policy, base_params, grid)  # before the bar
        seeds = tuple(args.seeds)
        total = (len(points) + len(rejected)) * len(seeds)
        skipped: list[tuple[dict[str, Any], str]] = []
        # a bar on a terminal only: in a log every refresh would be a line
        with tqdm(
            total=total, desc="simulations", unit="run", file=sys.stderr, disable=not sys.stderr.isatty()
        ) as bar:
            result = tune(
                profile,
                args.policy,
                base_params,
                grid,
                deployments[0],
                spec,
                args.objective,
                registry=registry,
                slo=Slo(args.slo_ttft, args.slo_tpot),
                seeds=seeds,
                tie_within=args.tie_within / 100.0,
                jobs=args.jobs,
                ladder=ladder_from_args(args),
                server_profile=servers,
                spec_details=args.spec_details,
                cache_tokens=args.cache_tokens,
                progress=bar.update,
                on_skip=lambda point, reason: skipped.append((point, reason)),
            )
        for point, reason in skipped:
            shown = ",".join(f"{k}={point[k]}" for k, _ in grid)
            print(f"warning: grid point {shown} skipped: {reason}", file=sys.stderr)
        keys = dict(grid)

        def label(r: PointResult) -> str:
            return ",".join(f"{k}={json.dumps(v)}" for k, v in r.params.items() if k in keys) or "-"

        offered = offered_tok_s(generate(spec, seeds[0]))
        where = f"{args.policy} on {deployment_text(deployments[0])}"
        swamped = [
            w
            for r in result.ranking
            if (w := swamp_warning(offered, f"{where} ({label(r)})", r.summary, full_batch_ttft_s(servers)))
        ]
        if swamped:
            others = len(swamped) - 1
            more = f" (and {others} other grid point{'s' * (others != 1)} likewise)" if others else ""
            print(f"warning: {swamped[0]}{more}", file=sys.stderr)
        print(_describe(spec, profile, servers) + native.describe())
        print(
            f"objective: {args.objective} ({OBJECTIVE_UNITS[args.objective]}); the mean over {len(seeds)} "
            f"seed{'s' * (len(seeds) != 1)} ({', '.join(map(str, seeds))}) with its 95% interval; a margin "
            f"inside its 95% interval or under {args.tie_within:g}% is a tie"
        )
        print(_tune_table(result, args.objective, label))
        if result.identical_seeds:
            print(
                f"note: every grid point scored the same on each of the {len(seeds)} seeds: this workload "
                "draws nothing from the seed (a trace replay takes its arrivals and lengths from the file), "
                "so each figure is one simulation's and has no interval; margins under "
                f"{args.tie_within:g}% are ties, larger ones are the simulation's exact differences"
            )
        best = result.best
        text = config_text(
            args.policy,
            best.params,
            profile_ref(args.profile),
            objective=args.objective,
            result=result,
            command="specroute " + shlex.join(sys.argv[1:]),
        )
        write_config(args.out, text)
        tie = ""
        if result.tied_with_best:
            tie = f", within the noise of {'; '.join(label(r) for r in result.tied_with_best)}: a tie"
        elif result.margins[0] is not None and result.margins[0].verdict == "n/a":
            tie = " (one seed: no confidence interval, give more --seeds)"
        print(f"best: {args.policy} {json.dumps(best.params)}{tie} -> {args.out}")
    except SIMULATION_ERRORS as e:
        raise CommandError(e) from None
    return 0
