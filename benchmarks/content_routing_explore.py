"""Exploration with a budget (issue 33), simulated: does trying EAGLE for request kinds predicted
slower there pay, which draw is better (Thompson sampling or an optimistic bound), and what does
it cost where nothing is to be found?

The setting is the issue's live one, in the simulator: the built-in `kimi-k25-int4-8gpu` profile
(EAGLE-3 only 3.7% faster than the plain server for a lone stream), one plain and one EAGLE-3
server, `spec_details` on, a closed loop of 3 clients sending 300 never-seen prompts of six task
types (`benchmarks/prompt_workloads.py`: HumanEval code, GSM8K math, general prose, BFCL tools,
fortunes to translate, Python reference passages to summarize; 50 of each, in a seeded order) with
200-token answers. True EAGLE speed factors: `rules` is the live benchmark's accept rules (code
1.5, prose 0.7, the rest 1.0); `uniform` every request 1 (nothing to find: what exploring costs).
Each request's factor gets a ±5% lognormal spread. `--live` is the live benchmark's twin
(`content_routing_live.py`): its prompts (300, as even a share of each installed task type as the
sources allow, its seeded pick and order) and its answer lengths (200 + i tokens for the i-th).

Runs: content-aware cost_model with `explore=thompson`, `explore=optimistic` (the default),
`explore_budget=0` (no exploration), and content-blind cost_model. Per run over `--seeds` seeds
(each a different order of the prompts): requests reaching EAGLE in the second half, code's and
prose's EAGLE share there and their median predicted factor (the truth: 1.5 and 0.7 with
`rules`), the median |true / predicted - 1| over the requests served by EAGLE (predicted: the
factor the policy used), mean and p99 e2e, and the exploration's share of decisions and the
predicted regret it spent over what its 1% budget allowed. Means ± 95% CI (t)
over seeds; ratios to content-blind paired per seed.

    python benchmarks/content_routing_explore.py            # 10 seeds
    python benchmarks/content_routing_explore.py --seeds 3
    python benchmarks/content_routing_explore.py --live --runs optimistic blind
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from content_routing_live import prompts as live_prompts
from prompt_workloads import task_requests

from policies.base import Decision, LoadView, Outcome, RequestInfo
from policies.cost_model import CostModelParams, CostModelPolicy
from policies.profile import resolve_profile
from policies.spec import PolicyContext
from policies.stats import estimate, percentile
from simulator.engine.deployment import build_deployment
from simulator.engine.loop import MEASURED, RequestBatch, simulate
from simulator.engine.prompts import parse_prompt_line

PROFILE = "kimi-k25-int4-8gpu"
TYPES = ("code", "math", "prose", "tools", "translate", "summarize")
PER_TYPE = 50
RULES = {"code": 1.5, "prose": 0.7}
"""The live benchmark's accept rules by task type; the rest 1.0."""
ANSWER_TOKENS = 200
LIVE_REQUESTS = 300
CONCURRENCY = 3
RUNS: dict[str, dict[str, Any]] = {
    "thompson": {"explore": "thompson"},
    "optimistic": {"explore": "optimistic"},
    "no-explore": {"explore_budget": 0.0},
    "blind": {"content_aware": False},
}


def prompts(seed: int) -> list[dict[str, Any]]:
    """PER_TYPE prompts of each of TYPES (the seed picks which and their order)."""
    rng = random.Random(f"prompts/{seed}")
    by: dict[str, list[dict[str, Any]]] = {}
    for r in task_requests(TYPES):
        by.setdefault(r["category"], []).append(r)
    out = []
    for t in TYPES:
        lines = by.get(t, [])
        out += rng.sample(lines, min(PER_TYPE, len(lines)))
    rng.shuffle(out)
    return out


class Recorder:
    """cost_model, recording each decision in arrival order."""

    def __init__(self, policy: CostModelPolicy) -> None:
        self.policy = policy
        self.name = policy.name
        self.decisions: list[Decision] = []

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        d = self.policy.choose(request, view, now)
        self.decisions.append(d)
        return d

    def observe(self, outcome: Outcome) -> None:
        self.policy.observe(outcome)

    def reset(self) -> None:
        self.policy.reset()


def one(job: tuple[str, str, int, bool]) -> dict[str, Any]:
    scenario, run, seed, live = job
    rows = live_prompts(LIVE_REQUESTS, seed) if live else prompts(seed)
    rng = random.Random(f"accept/{seed}")
    lines = [parse_prompt_line(r, f"{r['category']}") for r in rows]
    accept = [
        (RULES.get(r["category"], 1.0) if scenario == "rules" else 1.0)
        * rng.lognormvariate(-(0.05**2) / 2, 0.05)
        for r in rows
    ]
    n = len(lines)
    batch = answer_batch(lines, accept, [ANSWER_TOKENS + i if live else ANSWER_TOKENS for i in range(n)])
    profile = resolve_profile(PROFILE)
    policy = Recorder(CostModelPolicy(CostModelParams(**RUNS[run]), PolicyContext(profile, seed)))
    servers = build_deployment(profile, (("baseline", 1), ("eagle", 1)))
    raw = simulate(servers, policy, batch, concurrency=CONCURRENCY, seed=seed, spec_details=True)
    # requests are sent in batch order; decisions are recorded in the same order
    eagle = [s >= 0 and servers[s].pool == "eagle" for s in raw.server]
    half = n // 2
    cats = [r["category"] for r in rows]

    def share(kind: str) -> float:
        idx = [i for i in range(half, n) if cats[i] == kind]
        return sum(eagle[i] for i in idx) / len(idx) if idx else math.nan

    def predicted(kind: str) -> float:
        k = [
            d.accept_factor
            for i, d in enumerate(policy.decisions)
            if i >= half and cats[i] == kind and d.accept_factor is not None
        ]
        return statistics.median(k) if k else math.nan

    errors = [
        abs(accept[i] / d.accept_factor - 1.0)
        for i, d in enumerate(policy.decisions)
        if eagle[i] and d.accept_factor is not None
    ]
    e2e = [raw.finish[i] - raw.arrival[i] for i in range(n) if raw.phase[i] == MEASURED]
    explorer = policy.policy.explorer
    return {
        "late_eagle": sum(eagle[half:]),
        "code": share("code"),
        "prose": share("prose"),
        "code_predicted": predicted("code"),
        "prose_predicted": predicted("prose"),
        "error": statistics.median(errors) if errors else math.nan,
        "mean": statistics.fmean(e2e),
        "p99": percentile(e2e, 99),
        "explore_share": 0.0 if explorer is None else explorer.share,
        "spent_ratio": 0.0 if explorer is None else explorer.spent_ratio,
    }


def answer_batch(lines: list[Any], accept: list[float], answer_tokens: list[int]) -> RequestBatch:
    """The simulator's batch of `lines` (parsed prompts), the i-th answered with `answer_tokens[i]`
    tokens at its own acceptance factor."""
    n = len(lines)
    return RequestBatch(
        [p.prompt_tokens for p in lines],
        answer_tokens,
        answer_tokens,
        [None] * n,
        accept,
        None,
        features=[p.features for p in lines],
    )


def ci(values: list[float]) -> str:
    """Mean ±95% t-interval half-width of the non-NaN `values` (`policies.stats.estimate`)."""
    e = estimate([v for v in values if not math.isnan(v)])
    if e is None:
        return "n/a"
    return f"{e.mean:.3g}" if e.half_width is None else f"{e.mean:.3g} ±{e.half_width:.2g}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--live", action="store_true", help="The live benchmark's prompts and answer lengths.")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--scenarios", nargs="+", choices=("rules", "uniform"), default=["rules", "uniform"])
    args = p.parse_args()
    runs = list(dict.fromkeys([*args.runs, "blind"]))  # the ratios are to content-blind
    jobs = [(sc, r, seed, args.live) for sc in args.scenarios for r in runs for seed in range(args.seeds)]
    with ProcessPoolExecutor(args.workers) as pool:
        results = dict(zip(jobs, pool.map(one, jobs), strict=True))
    workload = (
        f"the live benchmark's {LIVE_REQUESTS} prompts, answers of {ANSWER_TOKENS} + i tokens"
        if args.live
        else f"{PER_TYPE} never-seen prompts of each of {', '.join(TYPES)}; {ANSWER_TOKENS}-token answers"
    )
    print(
        f"profile {PROFILE}; 1 plain + 1 EAGLE-3 server, spec_details; closed loop of {CONCURRENCY}, "
        f"{workload}; {args.seeds} seeds; mean ±95% CI over seeds\n"
    )
    for sc in args.scenarios:
        print(f"## {sc}\n")
        print(
            "| run | EAGLE-3 in 2nd half | code share | prose share | code predicted | prose predicted | "
            "median abs(true/pred - 1) | "
            "mean e2e s | p99 e2e s | mean / blind - 1 | p99 / blind - 1 | explore share | budget spent |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            cell = [results[(sc, r, s, args.live)] for s in range(args.seeds)]
            blind = [results[(sc, "blind", s, args.live)] for s in range(args.seeds)]
            rel_m = [c["mean"] / b["mean"] - 1 for c, b in zip(cell, blind, strict=True)]
            rel_p = [c["p99"] / b["p99"] - 1 for c, b in zip(cell, blind, strict=True)]
            cols = [
                ci([c["late_eagle"] for c in cell]),
                ci([c["code"] for c in cell]),
                ci([c["prose"] for c in cell]),
                ci([c["code_predicted"] for c in cell]),
                ci([c["prose_predicted"] for c in cell]),
                ci([c["error"] for c in cell]),
                ci([c["mean"] for c in cell]),
                ci([c["p99"] for c in cell]),
                ci([100 * x for x in rel_m]) + "%",
                ci([100 * x for x in rel_p]) + "%",
                ci([c["explore_share"] for c in cell]),
                ci([c["spent_ratio"] for c in cell]),
            ]
            print(f"| {r} | " + " | ".join(cols) + " |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
