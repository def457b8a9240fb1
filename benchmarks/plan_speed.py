"""Wall time of a 4-server `specroute plan` on the Azure LLM inference code trace.

The plan is the command's default: kinds baseline, eagle and adaptive (6 deployments), policies
cost_model, threshold and online tuned on the 3 mixed deployments (14 grid points each), 3
seeds, load factors 0.5, 1 and 1.5. It runs `--repeats` times per `--jobs` value; the script
prints per setting the number of timed runs, mean and min..max wall time, simulations and
simulated requests per second of wall time, and the speed-up of each setting over the first.

Data: Azure LLM inference trace 2023, code (CC-BY-4.0), Patel et al., "Splitwise: Efficient
Generative LLM Inference Using Phase Splitting", ISCA 2024. Read in place, never copied.

    python benchmarks/plan_speed.py [--trace FILE] [--repeats 3] [--jobs 1 2] [--servers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from policies.profile import resolve_profile
from policies.registry import default_registry
from simulator.engine.workloads import WorkloadSpec, generate
from simulator.planning.plan import PlanResult, PlanSpec, plan
from simulator.planning.report import format_plan

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/AzureLLMInferenceTrace_code.csv"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=os.environ.get("SPECROUTE_CODE_TRACE", str(DEFAULT_TRACE)))
    ap.add_argument("--profile", default="kimi-k25-int4-8gpu")
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--show-plan", action="store_true", help="Print the plan's ranking once.")
    args = ap.parse_args()
    if not Path(args.trace).is_file():
        print(f"trace not found: {args.trace} (set --trace or SPECROUTE_CODE_TRACE)", file=sys.stderr)
        return 2

    profile = resolve_profile(args.profile)
    workload = WorkloadSpec(kind="trace", trace=args.trace)
    requests = len(generate(workload, 0)[0].batch)
    spec = PlanSpec(
        servers=args.servers,
        kinds=("baseline", "eagle", "adaptive"),
        workload=workload,
        objective="mean_e2e_s",
    )
    registry = default_registry(entry_points=False)
    print(f"profile {profile.name!r}; trace {args.trace}: {requests} requests per simulation")
    print(f"machine: {os.cpu_count()} CPUs (shared; other work may be running)")

    first_mean: float | None = None
    result: PlanResult | None = None
    for jobs in args.jobs:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = plan(profile, spec, registry=registry, jobs=jobs)
            times.append(time.perf_counter() - t0)
        assert result is not None
        mean = statistics.fmean(times)
        first_mean = first_mean if first_mean is not None else mean
        sims = result.simulations
        print(
            f"jobs={jobs}: n={len(times)} runs, wall {mean:.2f} s "
            f"(min {min(times):.2f}, max {max(times):.2f}); "
            f"{sims} simulations, {sims * requests / mean:,.0f} simulated requests/s; "
            f"speed-up vs jobs={args.jobs[0]}: {first_mean / mean:.2f}x"
        )
    if args.show_plan and result is not None:
        print()
        print(format_plan(result, f"{args.servers} servers, Azure code trace"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
