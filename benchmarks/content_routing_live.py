"""Content-aware routing, live (issue 33): the real proxy (`cost_model`, the built-in
`kimi-k25-int4-8gpu` profile, `spec_details` on) in front of an emulated plain and an emulated
EAGLE-3 server whose acceptance follows content rules (`--accept-rules`: code 1.5x the profile's
accept length, prose 0.7x, everything else 1.0x), driven through the OpenAI client by 3 clients
at a time sending 300 never-seen prompts of six task types (50 each of HumanEval code, GSM8K
math, general prose, BFCL tool calls, fortunes to translate and Python reference passages to
summarize: `benchmarks/prompt_workloads.py`, which says where each comes from; a type whose
source is not installed is replaced by the others), streamed answers of 200 + i tokens for the
i-th prompt (a length per prompt: it finds the prompt's record, and is the same in every run).

The same prompts in the same order go through four proxies, each started fresh in front of fresh
emulators: content-blind (`content_aware=false`), content-aware with the optimistic bound's
exploration (the default), with Thompson sampling, and without exploration (`explore_budget=0`).
Per run: requests reaching EAGLE-3 in the second half, code's and prose's EAGLE-3 share there
and their median predicted factor (the truth: 1.5 and 0.7), the median |reported / predicted -
1| over the requests EAGLE-3 served (reported: the accept length the emulator sent over the
profile's; predicted: the factor the policy used), the client's mean and p99 end-to-end
seconds (95% CI of the mean), and the mean e2e against content-blind's paired per prompt (the
same prompt in both runs), with a 95% CI.

The emulators run the profile at `--time-scale` (wall seconds per profile second) and the proxy is
given the same speeds in wall time (the profile's rates divided by the time scale), so what it
predicts is what it sees. Wall-clock figures: run on a quiet machine. With `--rounds N` the four
runs repeat N times, in reverse order every other round (a machine that slows down over the
benchmark then weighs on every run alike); the table shows each round's figures, and the paired
comparison with content-blind is over every round's prompts (a round against its own blind run).

    python benchmarks/content_routing_live.py                     # time scale 0.2, 2 rounds, ~8 x 60 s
    python benchmarks/content_routing_live.py --time-scale 0.05 --runs aware blind
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import openai
from aiohttp import web
from prometheus_client import CollectorRegistry
from prompt_workloads import TASKS, task_requests

from controller.proxy.acceptance_metrics import reported_factor
from controller.proxy.app import create_app
from controller.proxy.config import Settings
from controller.proxy.core import policy_context
from controller.proxy.ticket import RequestRecord
from policies.profile import Profile, resolve_profile
from policies.registry import default_registry
from policies.stats import percentile
from simulator.emulator.accept_rules import parse_accept_rules
from simulator.emulator.app import EmulatorConfig, run_emulator
from simulator.engine.deployment import server_profile

PROFILE = "kimi-k25-int4-8gpu"
TYPES = ("code", "math", "prose", "tools", "translate", "summarize")
RULES = [
    {"match": r"^<\|user\|>\nComplete the following Python function", "factor": 1.5},
    {"match": r"^<\|user\|>\n(?:Give a concise encyclopedic|Explain [^\n]* to a curious)", "factor": 0.7},
]
"""HumanEval (code) 1.5, the general prose set 0.7, the rest 1.0: a regex per source."""
RUNS: dict[str, dict[str, Any]] = {
    "blind": {"content_aware": False},
    "aware": {},
    "thompson": {"explore": "thompson"},
    "no-explore": {"explore_budget": 0},
}
ANSWER_TOKENS = 200
"""The first prompt's answer length; the i-th prompt's is ANSWER_TOKENS + i."""
CONCURRENCY = 3


def prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """n never-seen prompts, as even a share of each of TYPES as their sources allow, shuffled."""
    rng = random.Random(f"live/{seed}")
    by: dict[str, list[dict[str, Any]]] = {}
    for r in task_requests(TYPES):
        by.setdefault(r["category"], []).append(r)
    kinds = [t for t in TYPES if by.get(t)]
    out: list[dict[str, Any]] = []
    for i, t in enumerate(kinds):
        take = n // len(kinds) + (i < n % len(kinds))
        out += rng.sample(by[t], min(take, len(by[t])))
    rng.shuffle(out)
    return out


def wall_profile(scale: float, folder: Path) -> tuple[Profile, Path]:
    """(the emulators' profile, the proxy's profile file: the same speeds in wall time)."""
    profile = resolve_profile(PROFILE)
    path = folder / "wall.json"
    path.write_text(server_profile(profile, speed={"baseline": 1 / scale, "eagle": 1 / scale}).to_json())
    return profile, path


async def run(params: dict[str, Any], lines: list[dict[str, Any]], scale: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        emulated, wall = wall_profile(scale, Path(tmp))
        base_cfg = EmulatorConfig(mode="baseline", profile=emulated, time_scale=scale)
        eagle_cfg = EmulatorConfig(
            mode="eagle", profile=emulated, time_scale=scale, accept_rules=parse_accept_rules(RULES)
        )
        async with run_emulator(base_cfg) as base, run_emulator(eagle_cfg) as eagle:
            settings = Settings.model_validate(
                {"baseline": [base.url], "eagle": [eagle.url], "policy": "cost_model", "profile": str(wall),
                 "policy_params": params, "spec_details": True, "health_check_interval_s": 60}
            )  # fmt: skip
            ctx = policy_context(settings)
            registry = default_registry(entry_points=False)
            policy = registry.create(settings.policy, settings.policy_params, ctx)
            records: dict[str, RequestRecord] = {}
            app = create_app(
                settings, policy, registry=registry, metrics_registry=CollectorRegistry(), context=ctx,
                observers=[lambda r: records.__setitem__(str(r.request.max_tokens), r)],
            )  # fmt: skip
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
            client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
            e2e: dict[int, float] = {}
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(len(lines)):
                queue.put_nowait(i)

            async def worker() -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    line = lines[i]
                    t0 = time.perf_counter()
                    # max_tokens tells the records apart (one length per prompt, the same in every run)
                    extra = {"ignore_eos": True, **({"tools": line["tools"]} if "tools" in line else {})}
                    stream = await client.chat.completions.create(
                        model="m", messages=line["messages"], max_tokens=ANSWER_TOKENS + i, stream=True,
                        extra_body=extra,
                    )  # fmt: skip
                    async for _ in stream:
                        pass
                    e2e[i] = time.perf_counter() - t0

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
            await client.close()
            await runner.cleanup()
    rows = []
    for i, line in enumerate(lines):
        r = records[str(ANSWER_TOKENS + i)]
        reported = reported_factor(r.policy, r.outcome)
        rows.append(
            {
                "kind": line["category"],
                "pool": r.decision.pool,
                "reason": r.decision.reason,
                "predicted": r.decision.accept_factor,
                "reported": reported,
                "e2e": e2e[i],
            }
        )
    return {"rows": rows, "explore": getattr(policy, "explorer", None)}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    half = rows[len(rows) // 2 :]

    def share(kind: str) -> float:
        k = [r for r in half if r["kind"] == kind]
        return sum(r["pool"] == "eagle" for r in k) / len(k) if k else math.nan

    def predicted(kind: str) -> float:
        k = [r["predicted"] for r in half if r["kind"] == kind and r["predicted"]]
        return statistics.median(k) if k else math.nan

    errors = [
        abs(r["reported"] / r["predicted"] - 1)
        for r in rows
        if r["pool"] == "eagle" and r["reported"] is not None and r["predicted"]
    ]
    e2e = [r["e2e"] for r in rows]
    m = statistics.fmean(e2e)
    h = 1.96 * statistics.stdev(e2e) / math.sqrt(len(e2e))
    return {
        "late_eagle": sum(r["pool"] == "eagle" for r in half),
        "code": share("code"),
        "prose": share("prose"),
        "code_predicted": predicted("code"),
        "prose_predicted": predicted("prose"),
        "error": statistics.median(errors) if errors else math.nan,
        "n_error": len(errors),
        "mean": m,
        "mean_ci": h,
        "p99": percentile(e2e, 99),
        "explored": sum(r["reason"] == "explore" for r in rows),
    }


def paired(rows: list[dict[str, Any]], blind: list[dict[str, Any]]) -> tuple[float, float]:
    """(mean e2e / blind's - 1, its 95% CI half-width), paired per prompt."""
    d = [a["e2e"] - b["e2e"] for a, b in zip(rows, blind, strict=True)]
    base = statistics.fmean(b["e2e"] for b in blind)
    return statistics.fmean(d) / base, 1.96 * statistics.stdev(d) / math.sqrt(len(d)) / base


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--time-scale", type=float, default=0.2, help="Emulators' wall seconds per profile second."
    )
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument(
        "--rounds", type=int, default=2, help="Repeat the runs, in reverse order every other round."
    )
    args = p.parse_args()
    lines = prompts(args.requests, args.seed)
    kinds = {
        t: sum(1 for x in lines if x["category"] == t)
        for t in TASKS
        if any(x["category"] == t for x in lines)
    }
    print(
        f"profile {PROFILE}, time scale {args.time_scale:g}; accept rules code 1.5, prose 0.7, rest 1.0; "
        f"{len(lines)} never-seen prompts {json.dumps(kinds)} at concurrency {CONCURRENCY}; "
        f"answers of {ANSWER_TOKENS} + i tokens\n"
    )
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    print(
        "| round | run | EAGLE-3 in 2nd half (n=150) | code share | prose share | code / prose predicted "
        "| median abs(reported/predicted - 1) (n) | explored | mean e2e s (95% CI) | p99 e2e s | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k in range(args.rounds):
        for name in args.runs if k % 2 == 0 else args.runs[::-1]:
            t0 = time.perf_counter()
            out = asyncio.run(run(RUNS[name], lines, args.time_scale))
            results[(name, k)] = out["rows"]
            s = summary(out["rows"])
            print(
                f"| {k} | {name} | {s['late_eagle']} | {s['code']:.2f} | {s['prose']:.2f} | "
                f"{s['code_predicted']:.2f} / {s['prose_predicted']:.2f} | "
                f"{s['error']:.3f} ({s['n_error']}) | {s['explored']} | "
                f"{s['mean']:.3f} ±{s['mean_ci']:.3f} | {s['p99']:.3f} | {time.perf_counter() - t0:.0f} |",
                flush=True,
            )
    if "blind" in args.runs:
        print()
        for name in args.runs:
            if name != "blind":
                rows = [r for k in range(args.rounds) for r in results[(name, k)]]
                blind = [r for k in range(args.rounds) for r in results[("blind", k)]]
                r, h = paired(rows, blind)
                print(
                    f"{name}: mean e2e vs content-blind, paired per prompt and round: {r:+.1%} ±{h:.1%} "
                    f"(n={len(rows)})"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
