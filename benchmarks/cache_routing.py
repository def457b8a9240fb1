"""Cache routing: cache-aware cost_model against cache-blind cost_model, round-robin and a
cache-only router, in the simulator with a prefix cache per server (issue 14).

Servers: the built-in kimi profile (`kimi-k25-int4-8gpu`): decode as fitted to the headline
figures; prefill 8000 prompt tokens/s on the plain server and 7600 on the EAGLE-3 server (the
profile's ESTIMATES, see its `source`), one prefill at a time per server; 1+1 and 2+2 servers.

Workloads:
- Mooncake's conversation trace (kvcache-ai/Mooncake, FAST25-release/traces, Apache-2.0; Qin et
  al., "Mooncake", FAST 2025), read from `../shared/data/traces/` (never copied): 12,031
  requests over 59 minutes, `hash_ids` of 512-token blocks. It is cut into `--windows`
  consecutive windows (each simulated from empty caches: the spread is across windows) and
  time-scaled so that the deployment runs at 50% or 90% of its capacity.
- The synthetic multi-turn workload (`--workload multiturn`): conversations sharing a 2048-token
  system prompt, exp:6 turns, user messages lognormal:800,1, answers lognormal:350,0.8, 60 s mean
  think time; `--windows` seeds; the request rate sets the load.

Capacity of a deployment on a workload: the arrival rate at which its busier resource saturates
when nothing is cached -- prefill (mean prompt tokens over the servers' summed prefill rates) or
decode (mean output tokens over the summed saturated decode throughputs: 773 and 354 tok/s). On
both workloads prefill is the bottleneck (12k-token prompts).

Cache sizes per server: "large" holds one hour of one server's contexts (the distinct prompt
tokens the workload sends in an hour, over the number of servers: each server could keep what it
is sent for an hour), "small" a tenth of that.

Figures per cell and router: mean over windows (min..max) of mean and p99 TTFT, mean and p99 e2e,
and cache hit ratio (cached / prompt tokens); n = requests measured in all windows; and the ratio
of each router's mean TTFT and mean e2e to cache-aware cost_model's (> 1: cache-aware is better),
window by window (mean, min..max).

Targets (issue 14): cache-aware beats every other router on mean TTFT and mean e2e in every cell;
with the large cache its mean TTFT is at least 20% below cache-blind cost_model's; with the small
cache it is never worse than cache-blind.

    python benchmarks/cache_routing.py            # the full run (~5 min on 2 shared cores)
    python benchmarks/cache_routing.py --quick    # a smoke check: 2 windows, fewer requests
"""

from __future__ import annotations

import argparse
import json
import math
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

from policies.params import parse_policy_ref
from policies.profile import Profile, resolve_profile
from simulator.engine.deployment import ServerKind
from simulator.engine.loop import RequestBatch
from simulator.engine.runner import PolicyChoice, run
from simulator.engine.traces import MOONCAKE_BLOCK_TOKENS, read_trace
from simulator.engine.workloads import LengthSpec, Segment, WorkloadSpec, generate

TRACE = (
    Path(__file__).resolve().parent.parent.parent
    / "shared"
    / "data"
    / "traces"
    / "mooncake_conversation_trace.jsonl"
)
PROFILE = "kimi-k25-int4-8gpu"
ROUTERS = ("cost_model", "cost_model:prefix_aware=false", "round_robin", "cache_only")
AWARE, BLIND = ROUTERS[0], ROUTERS[1]
LABELS = {AWARE: "cost_model (cache-aware)", BLIND: "cost_model (cache-blind)"}
DEPLOYMENTS: dict[str, tuple[tuple[ServerKind, int], ...]] = {
    "1+1": (("baseline", 1), ("eagle", 1)),
    "2+2": (("baseline", 2), ("eagle", 2)),
}
LOADS = (0.5, 0.9)
MULTITURN = {
    "turns": LengthSpec("exp", 6),
    "prompt_tokens": LengthSpec("lognormal", 800, 1.0),
    "output_tokens": LengthSpec("lognormal", 350, 0.8),
    "system_prompt_tokens": 2048,
    "think_time_s": 60.0,
}


@dataclass(frozen=True)
class Job:
    workload: str
    load: float
    deployment: str
    cache: str
    window: int
    router: str


def capacity_rps(
    profile: Profile, deployment: Sequence[tuple[ServerKind, int]], prompt: float, out: float
) -> float:
    """Requests/s at which the busier resource (prefill or decode) saturates with no cache hits."""
    prefill = decode = 0.0
    for kind, n in deployment:
        speed = profile.speed("eagle" if kind == "eagle" else "baseline")
        cap = speed.max_running_requests or 256
        prefill += n * (speed.prefill_tok_s or math.inf)
        decode += n * speed.throughput_tok_s(cap)
    return min(prefill / prompt, decode / out)


def unique_tokens_per_hour(batch: RequestBatch, span_s: float) -> float:
    assert batch.blocks is not None
    return len({b for blocks in batch.blocks for b in blocks}) * batch.block_tokens * 3600.0 / span_s


def mooncake_window(window: int, windows: int, requests: int | None, time_scale: float) -> RequestBatch:
    records = read_trace(TRACE, "mooncake")
    size = len(records) // windows
    part = records[window * size : (window + 1) * size]
    if requests is not None:
        part = part[:requests]
    t0 = part[0].t
    return RequestBatch(
        [r.prompt_tokens for r in part],
        [r.output_tokens or 1 for r in part],
        [r.output_tokens or 1 for r in part],
        [None] * len(part),
        [1.0] * len(part),
        [(r.t - t0) * time_scale for r in part],
        [r.blocks or () for r in part],
        MOONCAKE_BLOCK_TOKENS,
    )


def multiturn_batch(seed: int, rate: float, requests: int) -> RequestBatch:
    spec = WorkloadSpec(kind="multiturn", rate=rate, requests=requests, **MULTITURN)  # type: ignore[arg-type]
    return generate(spec, seed)[0].batch


def workload_facts(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Mean prompt and output tokens, distinct prompt tokens per hour at the unscaled rate."""
    records = read_trace(TRACE, "mooncake")
    span = records[-1].t - records[0].t
    moon = RequestBatch(
        [r.prompt_tokens for r in records],
        [r.output_tokens or 1 for r in records],
        [None] * len(records),
        [None] * len(records),
        [1.0] * len(records),
        [r.t for r in records],
        [r.blocks or () for r in records],
        MOONCAKE_BLOCK_TOKENS,
    )
    mt = multiturn_batch(0, 1.0, args.requests)
    assert mt.arrivals is not None
    return {
        "mooncake": {
            "prompt": statistics.fmean(moon.prompt_tokens),
            "output": statistics.fmean(moon.output_tokens),
            "rate": len(records) / span,
            "unique_per_hour_at_rate": unique_tokens_per_hour(moon, span),
        },
        "multiturn": {
            "prompt": statistics.fmean(mt.prompt_tokens),
            "output": statistics.fmean(mt.output_tokens),
            "rate": 1.0,
            "unique_per_hour_at_rate": unique_tokens_per_hour(mt, mt.arrivals[-1] - mt.arrivals[0]),
        },
    }


def cell_setup(args: argparse.Namespace, job: Job) -> tuple[RequestBatch, int]:
    """The job's requests and its per-server cache size in tokens."""
    profile = resolve_profile(PROFILE)
    facts = args.facts[job.workload]
    deployment = DEPLOYMENTS[job.deployment]
    servers = sum(n for _, n in deployment)
    rate = job.load * capacity_rps(profile, deployment, facts["prompt"], facts["output"])
    if job.workload == "mooncake":
        scale = facts["rate"] / rate  # trace time x scale = simulated time
        batch = mooncake_window(job.window, args.windows, args.requests, scale)
        per_hour = facts["unique_per_hour_at_rate"]  # one hour of trace time
    else:
        batch = multiturn_batch(1000 + job.window, rate, args.requests)
        per_hour = facts["unique_per_hour_at_rate"] * rate  # distinct tokens grow with the session rate
    large = int(per_hour / servers)
    return batch, large if job.cache == "large" else large // 10


def run_job(job_args: tuple[Job, argparse.Namespace]) -> dict[str, Any]:
    job, args = job_args
    batch, cache = cell_setup(args, job)
    name, params = parse_policy_ref(job.router)
    result = run(
        resolve_profile(PROFILE),
        PolicyChoice(name, params or {}),
        DEPLOYMENTS[job.deployment],
        [Segment(batch)],
        seed=job.window,
        cache_tokens=cache,
    )
    s = result.summary
    return {
        "n": s["requests"],
        "mean_ttft": s["mean_ttft_s"],
        "p99_ttft": s["p99_ttft_s"],
        "mean_e2e": s["mean_e2e_s"],
        "p99_e2e": s["p99_e2e_s"],
        "hit": s["cache_hit_ratio"] or 0.0,
        "cache_tokens": cache,
        "eagle_share": s["pool_share"]["eagle"],
    }


def spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ({fmt.format(min(values))}..{fmt.format(max(values))})"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Smoke check: 2 windows of at most 1500 requests.")
    ap.add_argument(
        "--windows", type=int, default=4, help="Trace windows / multiturn seeds per cell (default 4)."
    )
    ap.add_argument("--jobs", type=int, default=1, help="Worker processes (default 1: the cores are shared).")
    ap.add_argument("--json", metavar="FILE", help="Also write every figure as JSON.")
    args = ap.parse_args()
    if args.quick:
        args.windows = 2
    args.requests = 1500 if args.quick else 3000
    if not TRACE.is_file():
        print(f"missing {TRACE} (Mooncake's conversation trace, see SOURCES.md there)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    args.facts = workload_facts(args)
    profile = resolve_profile(PROFILE)
    print(
        f"cache routing: profile {PROFILE} (prefill 8000/7600 tok/s baseline/eagle: estimates); "
        f"{args.windows} windows/seeds x <= {args.requests} requests per cell; {args.jobs} worker(s); "
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    for w, f in args.facts.items():
        caps = {d: capacity_rps(profile, dep, f["prompt"], f["output"]) for d, dep in DEPLOYMENTS.items()}
        print(
            f"  {w}: mean prompt {f['prompt']:.0f} tokens, mean output {f['output']:.0f}; capacity "
            + ", ".join(f"{d} {c:.3f} req/s" for d, c in caps.items())
            + (f" (trace {f['rate']:.3f} req/s)" if w == "mooncake" else "")
        )
    jobs = [
        Job(w, load, dep, cache, k, router)
        for w in ("mooncake", "multiturn")
        for load in LOADS
        for dep in DEPLOYMENTS
        for cache in ("large", "small")
        for k in range(args.windows)
        for router in ROUTERS
    ]
    if args.jobs <= 1:
        outputs = [run_job((j, args)) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            outputs = list(pool.map(run_job, [(j, args) for j in jobs], chunksize=4))
    results = dict(zip(jobs, outputs, strict=True))
    targets: list[tuple[str, bool, str]] = []
    data: list[dict[str, Any]] = []
    for w in ("mooncake", "multiturn"):
        for load in LOADS:
            for dep in DEPLOYMENTS:
                for cache in ("large", "small"):
                    cell = f"{w} {load:.0%} {dep} {cache} cache"
                    per = {
                        r: [results[Job(w, load, dep, cache, k, r)] for k in range(args.windows)]
                        for r in ROUTERS
                    }
                    cache_tokens = per[AWARE][0]["cache_tokens"]
                    print(f"\n== {cell} ({cache_tokens / 1e6:.2f}M tokens per server) ==")
                    rows = []
                    for r in ROUTERS:
                        rs, aw = per[r], per[AWARE]
                        ttft_ratio = [x["mean_ttft"] / a["mean_ttft"] for x, a in zip(rs, aw, strict=True)]
                        e2e_ratio = [x["mean_e2e"] / a["mean_e2e"] for x, a in zip(rs, aw, strict=True)]
                        rows.append(
                            [
                                LABELS.get(r, r),
                                str(sum(x["n"] for x in rs)),
                                spread([x["mean_ttft"] for x in rs]),
                                spread([x["p99_ttft"] for x in rs], "{:.1f}"),
                                spread([x["mean_e2e"] for x in rs]),
                                spread([x["p99_e2e"] for x in rs], "{:.1f}"),
                                spread([x["hit"] for x in rs], "{:.3f}"),
                                "-" if r == AWARE else spread(ttft_ratio),
                                "-" if r == AWARE else spread(e2e_ratio),
                            ]
                        )
                        data.append({"cell": cell, "router": r, "windows": rs})
                    header = ["router", "n", "TTFT mean s", "TTFT p99 s", "e2e mean s", "e2e p99 s"]
                    header += ["hit ratio", "TTFT / aware", "e2e / aware"]
                    print(table(header, rows))

                    def mean(r: str, key: str, per: dict[str, list[dict[str, Any]]] = per) -> float:
                        return statistics.fmean(x[key] for x in per[r])

                    others = [r for r in ROUTERS if r != AWARE]
                    beats = all(
                        mean(AWARE, k) < mean(r, k) for r in others for k in ("mean_ttft", "mean_e2e")
                    )
                    worst = min(
                        min(mean(r, k) / mean(AWARE, k) for k in ("mean_ttft", "mean_e2e")) for r in others
                    )
                    targets.append(
                        (
                            f"{cell}: cache-aware best on mean TTFT and mean e2e",
                            beats,
                            f"worst ratio {worst:.3f}",
                        )
                    )
                    gain = 1.0 - mean(AWARE, "mean_ttft") / mean(BLIND, "mean_ttft")
                    if cache == "large":
                        targets.append(
                            (f"{cell}: mean TTFT >= 20% below cache-blind", gain >= 0.2, f"{gain:.1%} below")
                        )
                    else:
                        targets.append(
                            (
                                f"{cell}: mean TTFT never worse than cache-blind",
                                gain >= 0.0,
                                f"{gain:.1%} below",
                            )
                        )
    print("\n== targets (issue 14) ==")
    for what, ok, figure in targets:
        print(f"{'met' if ok else 'NOT MET':>7}  {what}: {figure}")
    met = sum(ok for _, ok, _ in targets)
    print(f"\n{met} of {len(targets)} targets met; {time.perf_counter() - start:.0f} s in all")
    if args.json:
        out = {
            "facts": args.facts,
            "cells": data,
            "targets": [{"target": w, "met": ok, "figure": f} for w, ok, f in targets],
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
