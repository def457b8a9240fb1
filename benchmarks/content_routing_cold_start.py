"""Exploration at cold start (issue 33), simulated: when the speed profile puts EAGLE-3 behind the
plain server on average, how soon does content-aware routing find the kind that pays there?

The setting is the real-engine test's (tests/vllm/test_eagle3_engine.py), in the simulator: the
servers run the built-in `tiny-vllm-cpu-code-eagle3` profile (measured on vLLM's CPU build) with
each request's EAGLE-3 acceptance at that profile's measured category factor (code 1.47, prose
0.53, ±5% lognormal per request); the policy believes the same profile with EAGLE-3's decode speed
cut by `--cut` (a profile measured on a slower or busier machine: at 0.6 EAGLE-3 is predicted
slower than plain at every batch for an average request, so without exploration nothing is sent
there and nothing learned). One plain and one EAGLE-3 server, `spec_details` on, a closed loop of 2
clients, `--warmup` then `--measured` never-seen prompts, half HumanEval code and half general
prose in a seeded order, 200-token answers; cost_model content-aware with `scope=request` (each
request where it is predicted to finish soonest) at several exploration budgets.

Per run over `--seeds` seeds: code's EAGLE-3 share in the first 20 and 40 requests and over the
warm-up, code's and prose's share over the measured part, explorations, the measured requests'
mean e2e, and the regret spent over what the budget allowed. Means ± 95% CI (t) over seeds.

    python benchmarks/content_routing_cold_start.py              # 10 seeds, --cut 0.6
    python benchmarks/content_routing_cold_start.py --cut 0.7 --seeds 5
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from content_routing_explore import answer_batch, ci
from prompt_workloads import task_requests

from policies.cost_model import CostModelParams, CostModelPolicy
from policies.profile import Profile, parse_profile, resolve_profile
from policies.spec import PolicyContext
from simulator.engine.deployment import build_deployment
from simulator.engine.loop import simulate
from simulator.engine.prompts import parse_prompt_line

PROFILE = "tiny-vllm-cpu-code-eagle3"
FACTORS = {"code": 1.4743, "prose": 0.5257}
"""The profile's measured per-category factors (its `categories`)."""
ANSWER_TOKENS = 200
CONCURRENCY = 2
RUNS: dict[str, dict[str, Any]] = {
    "no exploration": {"scope": "request", "explore_budget": 0.0},
    "budget 0.01 (default)": {"scope": "request"},
    "budget 0.05": {"scope": "request", "explore_budget": 0.05},
}


def believed(cut: float) -> Profile:
    """The servers' profile with EAGLE-3's decode speed times `cut`."""
    data = json.loads(resolve_profile(PROFILE).to_json())
    for point in data["modes"]["eagle"]["points"]:
        point["decode_tok_s"] *= cut
    return parse_profile(data, f"{PROFILE} x{cut}")


def one(job: tuple[str, int, float, int, int]) -> dict[str, float]:
    run, seed, cut, warmup, measured = job
    rng = random.Random(f"cold/{seed}")
    by: dict[str, list[dict[str, Any]]] = {}
    for r in task_requests(("code", "prose")):
        by.setdefault(r["category"], []).append(r)
    n = warmup + measured
    rows = rng.sample(by["code"], n // 2) + rng.sample(by["prose"], n - n // 2)
    rng.shuffle(rows)
    lines = [parse_prompt_line(r, r["category"]) for r in rows]
    accept = [FACTORS[r["category"]] * rng.lognormvariate(-(0.05**2) / 2, 0.05) for r in rows]
    batch = answer_batch(lines, accept, [ANSWER_TOKENS] * len(lines))
    policy = CostModelPolicy(CostModelParams(**RUNS[run]), PolicyContext(believed(cut), seed))
    servers = build_deployment(resolve_profile(PROFILE), (("baseline", 1), ("eagle", 1)))
    raw = simulate(servers, policy, batch, concurrency=CONCURRENCY, seed=seed, spec_details=True)
    eagle = [s >= 0 and servers[s].pool == "eagle" for s in raw.server]
    cats = [r["category"] for r in rows]

    def share(kind: str, lo: int, hi: int) -> float:
        idx = [i for i in range(lo, hi) if cats[i] == kind]
        return sum(eagle[i] for i in idx) / len(idx) if idx else math.nan

    explorer = policy.explorer
    return {
        "code 1-20": share("code", 0, 20),
        "code 1-40": share("code", 0, 40),
        "code warm-up": share("code", 0, warmup),
        "code measured": share("code", warmup, n),
        "prose measured": share("prose", warmup, n),
        "explorations": 0.0 if explorer is None else float(explorer.explored),
        "mean e2e s (measured)": statistics.fmean(raw.finish[i] - raw.arrival[i] for i in range(warmup, n)),
        "budget spent": 0.0 if explorer is None else explorer.spent_ratio,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--cut", type=float, default=0.6, help="EAGLE-3 decode speed the policy believes.")
    p.add_argument("--warmup", type=int, default=80)
    p.add_argument("--measured", type=int, default=80)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    if not 0.0 < args.cut <= 2.0 or args.warmup < 40 or args.measured < 2:
        p.error("--cut in (0, 2], --warmup >= 40, --measured >= 2")
    jobs = [(r, s, args.cut, args.warmup, args.measured) for r in RUNS for s in range(args.seeds)]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(one, jobs))
    print(
        f"servers {PROFILE}, the policy's profile with EAGLE-3 decode x{args.cut:g}; code {FACTORS['code']}, "
        f"prose {FACTORS['prose']}; closed loop of {CONCURRENCY}, {args.warmup} warm-up + "
        f"{args.measured} measured never-seen prompts (half code, half prose); scope=request; "
        f"{args.seeds} seeds; mean ±95% CI over seeds\n"
    )
    keys = list(results[0])
    print("| run | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for r in RUNS:
        cell = [res for job, res in zip(jobs, results, strict=True) if job[0] == r]
        print(f"| {r} | " + " | ".join(ci([c[k] for c in cell]) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
