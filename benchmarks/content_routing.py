"""Content-aware routing (issue 24): does predicting each request's EAGLE speed-up from what it
asks pay, and how well is the speed-up predicted?

Workloads: the prompts workloads of `benchmarks/prompt_workloads.py` (HumanEval code, GSM8K
math, general prose; each request's TRUE eagle speed factor from a scenario: `code-drafter`
(code 1.5 / math 1.0 / prose 0.8, the motivating deployment), `published` (per-task EAGLE-3
accept lengths of a Kimi drafter's model card, see that script) and `uniform` (acceptance does not
depend on content)), Poisson at three loads, `--requests` per run, answers lognormal:400,0.8
tokens, on the built-in `kimi-k25-int4-8gpu` profile.

Deployments and routers, all with two servers:
- `aware`: 1 plain + 1 EAGLE server, cost_model, content-aware (the default), spec_details on;
- `aware-timing`: the same, without spec_details (learns from decode timing only);
- `blind`: the pair, cost_model with content_aware=false (today's routing, no hints);
- `told`: the pair, content-blind cost_model, every request's category sent as its hint;
- `plain`: two plain servers; `eagle`: two EAGLE servers; `adaptive`: two EAGLE servers that adapt
  their draft depth in-engine (SGLang's `--speculative-adaptive` default ladder).

Per cell: mean and p99 e2e over `--seeds` seeds (each a different arrival sequence and order of
the file), as mean and 95% CI (t over seeds). Then the issue's targets: the share of the
told-hint gain over content-blind that content-aware captures, where that gain is >= 3%; and
content-aware against content-blind everywhere (<= +1% mean, <= +3% p99).

Prediction error: `|true factor / predicted - 1|` per request (the predicted factor is the
`Decision.accept_factor` the policy used; the true one the workload's), median over requests
500..end, per scenario at the middle load, with spec_details and with timing only.

    python benchmarks/content_routing.py             # the full run (several minutes)
    python benchmarks/content_routing.py --quick     # 2 seeds, 1000 requests
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompt_workloads import SCENARIOS, SPLITS, TASK_FACTORS, build, build_tasks, write

from policies.base import Decision, LoadView, Outcome, RequestFeatures, RequestInfo
from policies.cost_model import CostModelParams, CostModelPolicy
from policies.features import TRAIT_BITS
from policies.profile import resolve_profile
from policies.spec import PolicyContext
from policies.stats import percentile
from simulator.engine.deployment import ServerKind, build_deployment
from simulator.engine.loop import simulate
from simulator.engine.results import summarize
from simulator.engine.runner import PolicyChoice, run
from simulator.engine.workloads import LengthSpec, Segment, WorkloadSpec, generate

PROFILE = "kimi-k25-int4-8gpu"
LOADS = (0.5, 1.0, 2.0)
OUTPUT = LengthSpec("lognormal", 400, 0.8)
PAIR: tuple[tuple[ServerKind, int], ...] = (("baseline", 1), ("eagle", 1))
RUNS: dict[str, tuple[str, tuple[tuple[ServerKind, int], ...], bool, bool]] = {
    # name: (policy ref params, deployment, spec_details, hints file)
    "aware": ("", PAIR, True, False),
    "aware-timing": ("", PAIR, False, False),
    "blind": ("content_aware=false", PAIR, True, False),
    "told": ("content_aware=false", PAIR, True, True),
    "plain": ("", (("baseline", 2),), True, False),
    "eagle": ("", (("eagle", 2),), True, False),
    "adaptive": ("", (("adaptive", 2),), True, False),
}
T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


@dataclass(frozen=True)
class Job:
    scenario: str
    load: float
    run: str
    seed: int


def spec(path: Path, load: float, requests: int) -> WorkloadSpec:
    return WorkloadSpec(kind="prompts", prompts=str(path), rate=load, requests=requests, output_tokens=OUTPUT)


def run_job(job_args: tuple[Job, str, int]) -> dict[str, Any]:
    job, folder, requests = job_args
    params, deployment, details, hints = RUNS[job.run]
    path = Path(folder) / f"{job.scenario}{'-hints' if hints else ''}.jsonl"
    choice = PolicyChoice("cost_model", dict(p.split("=", 1) for p in params.split(",") if p))
    segments = generate(spec(path, job.load, requests), job.seed)
    result = run(resolve_profile(PROFILE), choice, deployment, segments, seed=job.seed, spec_details=details)
    s = result.summary
    return {"mean": s["mean_e2e_s"], "p99": s["p99_e2e_s"], "n": s["requests"]}


class Recorder:
    """cost_model, recording the accept factor it used for each request, in arrival order."""

    def __init__(self, policy: CostModelPolicy) -> None:
        self.policy = policy
        self.name = policy.name
        self.factors: list[float | None] = []

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        d = self.policy.choose(request, view, now)
        self.factors.append(d.accept_factor)
        return d

    def observe(self, outcome: Outcome) -> None:
        self.policy.observe(outcome)


def prediction_error(job_args: tuple[str, float, bool, str, int, int]) -> dict[str, Any]:
    scenario, load, details, folder, requests, seed = job_args
    profile = resolve_profile(PROFILE)
    batch = generate(spec(Path(folder) / f"{scenario}.jsonl", load, requests), seed)[0].batch
    rec = Recorder(CostModelPolicy(CostModelParams(), PolicyContext(profile, seed)))
    servers = build_deployment(profile, PAIR)
    simulate(servers, rec, batch, seed=seed, spec_details=details)
    errors = [
        abs(true / f - 1.0)
        for true, f in zip(batch.accept[500:], rec.factors[500:], strict=True)
        if f is not None
    ]
    content = rec.policy.content
    return {
        "median": statistics.median(errors),
        "p90": statistics.quantiles(errors, n=10)[-1],
        "n": len(errors),
        "families": 0 if content is None else content.model.families,
    }


HELD_OUT_RUNS: dict[str, tuple[str, bool]] = {
    # name: (policy params, hints file); every run on the pair, spec_details on
    "aware": ("", False),
    "thompson": ("explore=thompson", False),
    "no-explore": ("explore_budget=0", False),
    "blind": ("content_aware=false", False),
    "told": ("content_aware=false", True),
}


@dataclass(frozen=True)
class HeldOutJob:
    scenario: str
    split: str
    load: float
    run: str
    seed: int
    ablate: str = ""
    """A feature group of ABLATIONS taken out of every request's features ("": none)."""


def _traits(*names: str) -> int:
    return sum(TRAIT_BITS[n] for n in names)


ABLATIONS: dict[str, Any] = {
    # name: what is taken out of a request's features (every request, training and test)
    "code fences and syntax": {"traits": _traits("code_fence", "code")},
    "math notation": {"traits": _traits("math")},
    "non-English": {"traits": _traits("non_latin", "non_english")},
    "long document, short question": {"traits": _traits("long_doc_question")},
    "translate / summarize / extract": {"traits": _traits("translate", "summarize", "extract")},
    "JSON asked for": {"traits": _traits("json")},
    "tool schemas": {"traits": _traits("tool_schema"), "tools": True},
    "every trait": {"traits": sum(TRAIT_BITS.values()), "tools": True},
    "temperature and top_p": {"sampling": True},
    "prompt family": {"family": True},
    "text grams": {"grams": True},
}


def ablated(f: RequestFeatures | None, what: dict[str, Any]) -> RequestFeatures | None:
    if f is None:
        return None
    return dataclasses.replace(
        f,
        traits=f.traits & ~what.get("traits", 0),
        tools=0 if what.get("tools") else f.tools,
        temperature=None if what.get("sampling") else f.temperature,
        top_p=None if what.get("sampling") else f.top_p,
        family=0 if what.get("family") else f.family,
        grams=() if what.get("grams") else f.grams,
    )


def held_out_file(folder: str, scenario: str, split: str, part: str, hints: bool) -> Path:
    return Path(folder) / f"tasks-{scenario}-{split}-{part}{'-hints' if hints else ''}.jsonl"


def held_out_job(job_args: tuple[HeldOutJob, str, int, int]) -> dict[str, Any]:
    """Train on the split's task types, then test on the others: one policy across both segments
    (what it learned in training it keeps); the figures are the test segment's."""
    job, folder, train_n, test_n = job_args
    params, hints = HELD_OUT_RUNS[job.run]
    choice = PolicyChoice("cost_model", dict(p.split("=", 1) for p in params.split(",") if p))
    segments: list[Segment] = []
    for part, n in (("train", train_n), ("test", test_n)):
        path = held_out_file(folder, job.scenario, job.split, part, hints)
        segments += generate(spec(path, job.load, n), job.seed * 7 + (part == "test"))
    if job.ablate:
        what = ABLATIONS[job.ablate]
        segments = [
            dataclasses.replace(
                seg,
                batch=dataclasses.replace(
                    seg.batch, features=[ablated(f, what) for f in seg.batch.features or ()]
                ),
            )
            for seg in segments
        ]
    result = run(resolve_profile(PROFILE), choice, PAIR, segments, seed=job.seed, spec_details=True)
    s = summarize([result.samples[1]])
    return {"mean": s["mean_e2e_s"], "p99": s["p99_e2e_s"], "n": s["requests"]}


def write_task_files(folder: str, scenarios: list[str], temperatures: bool) -> None:
    """Every split's train and test files of each scenario, with and without hints."""
    for scenario in scenarios:
        for split, (train, test) in SPLITS.items():
            for part, types in (("train", train), ("test", test)):
                for hints in (False, True):
                    lines = build_tasks(
                        scenario, types=types, sigma=0.08, hints=hints, temperatures=temperatures
                    )
                    write(held_out_file(folder, scenario, split, part, hints), lines)


def held_out(args: argparse.Namespace) -> None:
    """Capture on task types held out from training, per split, scenario and load."""
    runs = list(HELD_OUT_RUNS)
    with tempfile.TemporaryDirectory(prefix="specroute-tasks-") as folder:
        write_task_files(folder, args.task_scenarios, args.temperatures)
        jobs = [
            HeldOutJob(sc, split, load, r, seed)
            for sc in args.task_scenarios
            for split in args.splits
            for load in LOADS
            for r in runs
            for seed in range(args.first_seed, args.first_seed + args.seeds)
        ]
        sizes = {
            (sc, split): args.test
            or len(held_out_file(folder, sc, split, "test", False).read_text().splitlines())
            for sc in args.task_scenarios
            for split in args.splits
        }
        with ProcessPoolExecutor(args.workers) as pool:
            results = list(
                pool.map(held_out_job, [(j, folder, args.train, sizes[(j.scenario, j.split)]) for j in jobs])
            )
    by: dict[tuple[str, str, float, str], list[dict[str, Any]]] = {}
    for job, res in zip(jobs, results, strict=True):
        by.setdefault((job.scenario, job.split, job.load, job.run), []).append(res)
    print(
        f"## held-out task types: {args.train} training requests of the split's train types, then "
        f"{args.test or 'each of'} its test prompts (figures: the test requests); {args.seeds} seeds "
        "per cell; "
        f"temperatures {'on' if args.temperatures else 'off'}; mean e2e s +- 95% CI over seeds; "
        f"captured: share of the told gain, 95% bootstrap interval over seeds ({BOOTSTRAP} "
        "resamples); aware - told: paired per seed, mean +- 95% CI (t)\n"
    )
    for split in args.splits:
        train, test = SPLITS[split]
        print(f"split {split}: train {', '.join(train)}; test {', '.join(test)}")
    print()
    print(
        "| scenario | split | req/s | "
        + " | ".join(runs)
        + " | told gain | captured [95% CI] | aware - told s | aware vs blind mean / p99 |"
    )
    print("|---|---|---|" + "---|" * len(runs) + "---|---|---|---|")
    for sc in args.task_scenarios:
        for split in args.splits:
            for load in LOADS:
                cells = []
                for r in runs:
                    m, h = ci([c["mean"] for c in by[(sc, split, load, r)]])
                    cells.append(f"{m:.2f} ±{h:.2f}")
                mean = {r: statistics.fmean(c["mean"] for c in by[(sc, split, load, r)]) for r in runs}
                p99 = {r: statistics.fmean(c["p99"] for c in by[(sc, split, load, r)]) for r in runs}
                gain = 1.0 - mean["told"] / mean["blind"]
                got = 1.0 - mean["aware"] / mean["blind"]
                share = "n/a (< 3%)"
                if gain >= 0.03:
                    low, high = capture_ci(*([c["mean"] for c in by[(sc, split, load, r)]] for r in BTA))
                    share = f"{got / gain:.0%} [{low:.0%}, {high:.0%}]"
                # paired: a seed is the same arrivals and order of the files in every run
                pairs = zip(by[(sc, split, load, "aware")], by[(sc, split, load, "told")], strict=True)
                dm, dh = ci([a["mean"] - t["mean"] for a, t in pairs])
                vs = f"{mean['aware'] / mean['blind'] - 1:+.1%} / {p99['aware'] / p99['blind'] - 1:+.1%}"
                print(
                    f"| {sc} | {split} | {load:g} | "
                    + " | ".join(cells)
                    + f" | {gain:+.1%} | {share} | {dm:+.3f} ±{dh:.3f} | {vs} |"
                )
    print()


def ablation(args: argparse.Namespace) -> None:
    """Each feature group's contribution: held-out capture with it taken out, per split."""
    load, scenario = 1.0, args.task_scenarios[0]
    variants = ["", *ABLATIONS]
    with tempfile.TemporaryDirectory(prefix="specroute-tasks-") as folder:
        write_task_files(folder, [scenario], args.temperatures)
        sizes = {
            split: args.test
            or len(held_out_file(folder, scenario, split, "test", False).read_text().splitlines())
            for split in SPLITS
        }
        jobs = [
            HeldOutJob(scenario, split, load, "aware", seed, v)
            for split in SPLITS
            for v in variants
            for seed in range(args.seeds)
        ] + [
            HeldOutJob(scenario, split, load, r, seed)
            for split in SPLITS
            for r in ("blind", "told")
            for seed in range(args.seeds)
        ]
        with ProcessPoolExecutor(args.workers) as pool:
            results = list(pool.map(held_out_job, [(j, folder, args.train, sizes[j.split]) for j in jobs]))
    by: dict[tuple[str, str, str], list[float]] = {}
    for job, res in zip(jobs, results, strict=True):
        by.setdefault((job.split, job.run, job.ablate), []).append(res["mean"])
    print(
        f"## feature ablation: scenario {scenario}, {load:g} req/s, temperatures "
        f"{'on' if args.temperatures else 'off'}; {args.train} training requests, then each test prompt "
        "once; "
        f"{args.seeds} seeds; captured share of the told gain on the held-out task types (mean e2e, "
        "mean over seeds), and the change against all features\n"
    )
    print("| taken out | " + " | ".join(SPLITS) + " |")
    print("|---|" + "---|" * len(SPLITS))
    full = {}
    for v in variants:
        cells = []
        for split in SPLITS:
            blind = statistics.fmean(by[(split, "blind", "")])
            told = statistics.fmean(by[(split, "told", "")])
            aware = statistics.fmean(by[(split, "aware", v)])
            got = (blind - aware) / (blind - told) if blind - told > 0 else math.nan
            if not v:
                full[split] = got
                cells.append(f"{got:.0%}")
            else:
                cells.append(f"{got:.0%} ({got - full[split]:+.0%})")
        print(f"| {v or 'nothing (all features)'} | " + " | ".join(cells) + " |")
    print()


BTA = ("blind", "told", "aware")
BOOTSTRAP = 4000
"""Resamples of the seeds for the capture's interval."""


def capture_ci(blind: list[float], told: list[float], aware: list[float]) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the captured share (blind - aware) / (blind - told) of
    the means over seeds, resampling whole seeds (a seed's three runs share its arrivals, so the
    pairing is kept); a fixed bootstrap seed, so the same figures give the same interval. NaN
    when a resample has no told gain: the share is unbounded there."""
    rng = random.Random("held-out/capture")
    n = len(blind)
    shares = []
    for _ in range(BOOTSTRAP):
        pick = [rng.randrange(n) for _ in range(n)]
        b, t, a = (math.fsum(v[i] for i in pick) for v in (blind, told, aware))
        if b - t <= 0:
            return math.nan, math.nan
        shares.append((b - a) / (b - t))
    return percentile(shares, 2.5), percentile(shares, 97.5)


def ci(values: list[float]) -> tuple[float, float]:
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.nan
    return m, T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 seeds, 1000 requests per run.")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--markdown", action="store_true", help="Also print docs/content-routing.md's table.")
    p.add_argument(
        "--held-out",
        action="store_true",
        help="Only the held-out task-type runs (train on some types, test on others).",
    )
    p.add_argument(
        "--ablation",
        action="store_true",
        help="Only the feature ablation (held-out capture without each group).",
    )
    p.add_argument("--task-scenarios", nargs="+", default=list(TASK_FACTORS), choices=TASK_FACTORS)
    p.add_argument(
        "--splits", nargs="+", default=list(SPLITS), choices=SPLITS, help="Held-out runs: the splits."
    )
    p.add_argument("--first-seed", type=int, default=0, help="Held-out runs: the first seed.")
    p.add_argument("--train", type=int, default=2000, help="Held-out runs: training requests.")
    p.add_argument(
        "--test",
        type=int,
        default=None,
        help="Held-out runs: test requests (default: each test prompt once).",
    )
    p.add_argument(
        "--no-temperatures",
        dest="temperatures",
        action="store_false",
        help="Held-out runs: no sampling temperatures in the task files.",
    )
    args = p.parse_args()
    if args.quick:
        args.seeds, args.requests = 2, 1000
    if args.held_out:
        held_out(args)
        return 0
    if args.ablation:
        ablation(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="specroute-prompts-") as folder:
        for scenario in args.scenarios:
            for hints in (False, True):
                write(
                    Path(folder) / f"{scenario}{'-hints' if hints else ''}.jsonl",
                    build(scenario, sigma=0.08, hints=hints),
                )
        jobs = [
            Job(s, load, r, seed)
            for s in args.scenarios
            for load in LOADS
            for r in RUNS
            for seed in range(args.seeds)
        ]
        err_jobs = [
            (s, 1.0, details, folder, max(args.requests, 1000), seed)
            for s in args.scenarios
            for details in (True, False)
            for seed in range(min(args.seeds, 3))
        ]
        with ProcessPoolExecutor(args.workers) as pool:
            results = list(pool.map(run_job, [(j, folder, args.requests) for j in jobs]))
            errors = list(pool.map(prediction_error, err_jobs))
    by: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for job, res in zip(jobs, results, strict=True):
        by.setdefault((job.scenario, job.load, job.run), []).append(res)
    print(
        f"profile {PROFILE}; {args.requests} requests per run, {args.seeds} seeds per cell; "
        f"answers {OUTPUT}; mean and 95% CI over seeds (t)\n"
    )
    for scenario in args.scenarios:
        print(f"## {scenario}\n")
        print("| load req/s | run | mean e2e s | p99 e2e s |")
        print("|---|---|---|---|")
        for load in LOADS:
            for r in RUNS:
                cell = by[(scenario, load, r)]
                m, mh = ci([c["mean"] for c in cell])
                q, qh = ci([c["p99"] for c in cell])
                print(f"| {load:g} | {r} | {m:.2f} +- {mh:.2f} | {q:.1f} +- {qh:.1f} |")
        print()
        for load in LOADS:
            mean = {r: statistics.fmean(c["mean"] for c in by[(scenario, load, r)]) for r in RUNS}
            p99 = {r: statistics.fmean(c["p99"] for c in by[(scenario, load, r)]) for r in RUNS}
            gain = 1.0 - mean["told"] / mean["blind"]
            got = 1.0 - mean["aware"] / mean["blind"]
            got_t = 1.0 - mean["aware-timing"] / mean["blind"]
            share = "n/a (gain < 3%)"
            if gain >= 0.03:
                share = f"{got / gain:.0%} (timing only {got_t / gain:.0%})"
            rm, rp = mean["aware"] / mean["blind"] - 1, p99["aware"] / p99["blind"] - 1
            tm, tp = mean["aware-timing"] / mean["blind"] - 1, p99["aware-timing"] / p99["blind"] - 1
            # paired: the same seed is the same arrivals and order of the file in every run
            pairs = zip(by[(scenario, load, "aware")], by[(scenario, load, "blind")], strict=True)
            pm, ph = ci([a["mean"] / b["mean"] - 1 for a, b in pairs])
            print(
                f"load {load:g}: told-hint gain over blind {gain:+.1%}; aware {got:+.1%}, timing only "
                f"{got_t:+.1%}; captured {share}; aware vs blind mean {rm:+.1%}, p99 {rp:+.1%} "
                f"(timing only: mean {tm:+.1%}, p99 {tp:+.1%}); aware/blind - 1 paired per seed "
                f"{pm:+.1%} +- {ph:.1%}"
            )
        print()
    if args.markdown:
        print(readme_table(args.scenarios, by))
    seeds = sorted({job[5] for job in err_jobs})
    print(f"## prediction error after 500 requests (load 1 req/s; seeds {seeds}: mean (min..max))\n")
    print("| scenario | signal | median abs(true/predicted - 1) | p90 | n per seed | families tracked |")
    print("|---|---|---|---|---|---|")
    grouped: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for (s, _, details, _, _, _), e in zip(err_jobs, errors, strict=True):
        grouped.setdefault((s, details), []).append(e)
    for (s, details), es in grouped.items():
        signal = "spec_details" if details else "timing only"

        def spread(key: str, es: list[dict[str, Any]] = es) -> str:
            v = [e[key] for e in es]
            return f"{statistics.fmean(v):.3f} ({min(v):.3f}..{max(v):.3f})"

        print(
            f"| {s} | {signal} | {spread('median')} | {spread('p90')} | {es[0]['n']} | {es[0]['families']} |"
        )
    return 0


def readme_table(scenarios: list[str], by: dict[tuple[str, float, str], list[dict[str, Any]]]) -> str:
    """docs/content-routing.md's table: per scenario and load, mean / p99 e2e ± 95% CI of each run."""
    runs = ("aware", "aware-timing", "blind", "told", "plain", "eagle", "adaptive")
    lines = [
        "| scenario | req/s | aware | timing only | blind | told | 2x plain | 2x EAGLE | 2x adaptive |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario in scenarios:
        for load in LOADS:
            cells = []
            for r in runs:
                cell = by[(scenario, load, r)]
                m, mh = ci([c["mean"] for c in cell])
                q, qh = ci([c["p99"] for c in cell])
                cells.append(f"{m:.2f} ±{mh:.2f} / {q:.1f} ±{qh:.1f}")
            lines.append(f"| {scenario} | {load:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
