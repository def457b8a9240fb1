"""Several specroute replicas in front of the same pools: how much herding costs, in the simulator.

Each cell is one profile (the built-in ones), one workload and one load: Poisson arrivals at
60% and 90% of the pair's capacity (baseline=1,eagle=1; capacity = the best static split's
request rate with every slot busy, output lengths exp:200), and the Azure LLM inference traces
2023 (code, conversation; Patel et al., "Splitwise", ISCA 2024, CC-BY-4.0; read from
/work/shared/data/traces) replayed at 60% and 90% of capacity, each seed its own window of
the trace. The policy is serve's default with a profile (cost_model). Every cell runs
R = 1, 2, 4, 8, 16 routers (`simulate --routers`, arrivals split at random, each router's
scrape at its own phase) at scrape intervals 1 s (serve's default), 0.25 s and 5 s, and
reports mean / p99 end-to-end and TTFT of R routers over R = 1 at the same scrape interval,
on the same requests (paired per seed), as mean (min..max) over the seeds, with n the
measured requests per run and the fraction of router pairs whose views disagreed.

Variants (`--variants`): `plain` (no herding prevention) and `replicas` (serve's `replicas`
setting = R: each router counts its own traffic since a scrape R times). Target (issue 18):
R = 8 within 5% of R = 1 on mean e2e and within 10% on p99 e2e, at 60% and 90% load, on every
profile and trace, at the default scrape interval.

    python benchmarks/replicas.py                 # the full run (~15 min on 2 shared cores)
    python benchmarks/replicas.py --quick         # a smoke check: 1 seed, smaller runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decision_quality import TRACES, capacity_rps, profiles

from policies.params import parse_policy_ref
from simulator.engine.loop import RequestBatch
from simulator.engine.replica_views import RouterSetup
from simulator.engine.runner import PolicyChoice, run
from simulator.engine.traces import read_trace
from simulator.engine.workloads import LengthSpec, Segment, WorkloadSpec, generate

ROUTERS = (1, 2, 4, 8, 16)
INTERVALS = (1.0, 0.25, 5.0)
LOADS = (0.6, 0.9)
PROFILES = ("kimi", "llama")
POLICY = "cost_model"
VARIANTS = {
    "plain": (POLICY, False),
    "replicas": (POLICY, True),
}
"""name: (policy, whether each router is told `replicas` = R)."""
OUTPUT = LengthSpec("exp", 200)
TARGET_MEAN, TARGET_P99, TARGET_R = 1.05, 1.10, 8


@dataclass(frozen=True)
class Cell:
    profile: str
    workload: str
    """poisson, azure-code, azure-conv"""
    load: float


@dataclass(frozen=True)
class Job:
    cell: Cell
    variant: str
    routers: int
    interval: float
    seed: int
    requests: int


WINDOWS = 3
"""A trace is cut into this many disjoint windows; seed s replays window s mod WINDOWS."""


def _trace_batch(name: str, seed: int, size: int, scale_to: float) -> RequestBatch:
    """Window `seed` of the trace (at most `size` requests), its arrivals scaled to a mean rate of
    `scale_to` per second."""
    records = read_trace(str(TRACES / f"AzureLLMInferenceTrace_{name}.csv"), None, limit=None)
    size = min(size, len(records) // WINDOWS)
    window = records[seed % WINDOWS * size : (seed % WINDOWS + 1) * size]
    t0 = window[0].t
    rate = len(window) / (window[-1].t - t0)
    scale = rate / scale_to
    out = [r.output_tokens or 1 for r in window]
    return RequestBatch(
        [r.prompt_tokens for r in window],
        out,
        [r.max_tokens if r.max_tokens is not None else o for r, o in zip(window, out, strict=True)],
        [None] * len(window),
        [1.0] * len(window),
        [(r.t - t0) * scale for r in window],
    )


def _trace_mean_output(name: str) -> float:
    records = read_trace(str(TRACES / f"AzureLLMInferenceTrace_{name}.csv"), None, limit=None)
    return statistics.fmean(r.output_tokens or 1 for r in records)


def segments(job: Job) -> list[Segment]:
    cell = job.cell
    profile = profiles()[cell.profile]
    if cell.workload == "poisson":
        rate = cell.load * capacity_rps(profile, OUTPUT)
        spec = WorkloadSpec(kind="poisson", rate=rate, requests=job.requests, output_tokens=OUTPUT)
        return generate(spec, job.seed)
    name = cell.workload.removeprefix("azure-")
    cap = capacity_rps(profile, LengthSpec("const", _trace_mean_output(name)))
    return [Segment(_trace_batch(name, job.seed, job.requests, cell.load * cap))]


def run_job(job: Job) -> dict[str, Any]:
    policy, told = VARIANTS[job.variant]
    name, params = parse_policy_ref(policy)
    setup = RouterSetup(job.routers, job.interval, "random", float(job.routers) if told else 1.0)
    result = run(
        profiles()[job.cell.profile],
        PolicyChoice(name, params or {}),
        (("baseline", 1), ("eagle", 1)),
        segments(job),
        seed=job.seed,
        routers=setup,
    )
    return result.to_json()


def spread(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ({fmt.format(min(values))}..{fmt.format(max(values))})"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in [header, *rows]
    )


METRICS = (
    ("mean_e2e_s", "e2e mean"),
    ("p99_e2e_s", "e2e p99"),
    ("mean_ttft_s", "TTFT mean"),
    ("p99_ttft_s", "TTFT p99"),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 seed, 2000 requests per run, R 1 2 8 16.")
    ap.add_argument("--seeds", type=int, default=3, help="Seeds per configuration (default 3).")
    ap.add_argument("--requests", type=int, default=5000, help="Requests per run (default 5000).")
    ap.add_argument("--routers", type=int, nargs="+", default=list(ROUTERS))
    ap.add_argument("--intervals", type=float, nargs="+", default=list(INTERVALS))
    ap.add_argument(
        "--other-routers",
        type=int,
        nargs="+",
        default=[1, 8, 16],
        help="Routers run at scrape intervals other than 1 s (default 1 8 16).",
    )
    ap.add_argument("--loads", type=float, nargs="+", default=list(LOADS))
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES))
    ap.add_argument("--workloads", nargs="+", default=["poisson", "azure-code", "azure-conv"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--jobs", type=int, default=1, help="Worker processes (default 1: the cores are shared).")
    ap.add_argument("--json", metavar="FILE", help="Also write every figure as JSON.")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.requests = 1, 2000
        args.routers = [r for r in args.routers if r in (1, 2, 8, 16)]
    seeds = list(range(args.seeds))
    routers = sorted(set(args.routers) | {1})
    cells = [Cell(p, w, load) for p in args.profiles for w in args.workloads for load in args.loads]
    jobs = [
        Job(c, v, r, s, seed, args.requests)
        for c in cells
        for v in args.variants
        for s in args.intervals
        for r in routers
        for seed in seeds
        if not (v != "plain" and r == 1)  # the setting is 1 with one router: same as plain
        and (s == 1.0 or r in args.other_routers or r == 1)
    ]
    print(
        f"replicas: profiles {', '.join(args.profiles)}; workloads {', '.join(args.workloads)}; loads "
        f"{', '.join(f'{100 * x:.0f}%' for x in args.loads)} of capacity; policy {POLICY}; "
        f"routers {routers}; "
        f"scrape intervals {args.intervals} s; seeds {seeds}; {args.requests} requests per run; "
        f"{len(jobs)} runs; {args.jobs} worker(s); {os.cpu_count()} CPUs",
        flush=True,
    )
    start = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            outs = list(pool.map(run_job, jobs, chunksize=4))
    else:
        outs = [run_job(j) for j in jobs]
    results = dict(zip(jobs, outs, strict=True))

    def get(c: Cell, v: str, r: int, s: float, seed: int) -> dict[str, Any]:
        if r == 1:
            v = "plain"
        return results[Job(c, v, r, s, seed, args.requests)]

    data: dict[str, Any] = {}
    verdicts: list[tuple[str, bool, str]] = []
    for c in cells:
        for s in args.intervals:
            rows = []
            for v in args.variants:
                for r in routers:
                    if (r == 1 and v != "plain") or (s != 1.0 and r not in args.other_routers and r != 1):
                        continue
                    runs = [get(c, v, r, s, seed) for seed in seeds]
                    refs = [get(c, v, 1, s, seed) for seed in seeds]
                    ratios = {
                        key: [x["summary"][key] / y["summary"][key] for x, y in zip(runs, refs, strict=True)]
                        for key, _ in METRICS
                    }
                    views = [x.get("routers", {}).get("view_disagreement") or 0.0 for x in runs]
                    eagle = [x["summary"]["pool_share"]["eagle"] for x in runs]
                    absolute = " / ".join(
                        f"{statistics.fmean(x['summary'][k] for x in runs):.2f}"
                        for k in ("mean_e2e_s", "p99_e2e_s")
                    )
                    rows.append(
                        [
                            v,
                            str(r),
                            str(runs[0]["summary"]["requests"]),
                            absolute,
                            *(spread(ratios[k]) for k, _ in METRICS),
                            spread([100 * x for x in views], "{:.0f}"),
                            spread([100 * x for x in eagle], "{:.0f}"),
                        ]
                    )
                    key = f"{c.profile} {c.workload} {100 * c.load:.0f}% S={s:g} {v} R={r}"
                    data[key] = {
                        "ratios": ratios,
                        "summaries": [x["summary"] for x in runs],
                        "routers": [x.get("routers") for x in runs],
                    }
                    if r == TARGET_R and s == 1.0:
                        m, p = statistics.fmean(ratios["mean_e2e_s"]), statistics.fmean(ratios["p99_e2e_s"])
                        verdicts.append(
                            (
                                f"{c.profile} {c.workload} {100 * c.load:.0f}% {v}",
                                m <= TARGET_MEAN and p <= TARGET_P99,
                                f"mean x{spread(ratios['mean_e2e_s'])}, p99 x{spread(ratios['p99_e2e_s'])}",
                            )
                        )
            print(
                f"\n== {c.profile}, {c.workload} at {100 * c.load:.0f}% of capacity, scrape every {s:g} s =="
            )
            print(
                table(
                    ["variant", "R", "n", "e2e mean/p99 s", *(f"{h} /R=1" for _, h in METRICS),
                     "views differ %", "eagle %"],
                    rows,
                )
            )  # fmt: skip
    print(f"\n== target: R={TARGET_R} within 5% of R=1 on mean e2e and 10% on p99 e2e (scrape 1 s) ==")
    for what, ok, figure in verdicts:
        print(f"{'met' if ok else 'MISSED':>7}  {what}: {figure}")
    print(f"\n{time.perf_counter() - start:.0f} s in all")
    if args.json:
        data["targets"] = [{"cell": w, "met": ok, "figure": f} for w, ok, f in verdicts]
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
