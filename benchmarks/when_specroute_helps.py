"""When does a plain + EAGLE-3 pair behind specroute beat two plain servers? The planner's answer
on the built-in profiles, for docs/when-specroute-helps.md.

For each built-in profile and a ladder of Poisson arrival rates, plus one bursty workload (rate
x10 and back, 60 s on average in each state), with 200-token answers and 256-token prompts, it
runs `specroute plan --servers 2 --kinds baseline,eagle,adaptive --json` (printed, so each figure
can be checked by hand) and reports mean end-to-end latency with its 95% CI over the planner's
seeds for two plain servers (least-loaded), the plain + EAGLE-3 pair (the best tuned routing
policy), two EAGLE-3 servers and two EAGLE-3 servers that adapt their draft depth in-engine
(SGLang's default `--speculative-adaptive` ladder, at the plain server's cap), the pair's
difference against two plain servers with a paired 95% CI across seeds, the verdict with
`plan`'s own rule (a margin inside its CI or under 1% is a tie), and the best of the four with
what `plan` finds tied with it. Re-run it after changing a policy or a profile; the table in
docs/when-specroute-helps.md is its `--markdown` output.

    python benchmarks/when_specroute_helps.py [--markdown] [--profiles NAME ...] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.profile import resolve_profile
from policies.stats import paired_margin

RATES: dict[str, tuple[float, ...]] = {
    # requests/s; two plain kimi servers saturate near 2 x 773 tok/s = ~7.7 req/s of 200 tokens
    "kimi-k25-int4-8gpu": (0.2, 0.5, 1.0, 2.0, 4.0, 6.0),
    # two plain llama-8B servers reach ~10k tok/s at batch 64 (~50 req/s); EAGLE-3 caps at 48 running
    "llama31-8b-h100-eagle3": (1.0, 5.0, 10.0, 20.0, 40.0, 80.0),
}
BURSTY_RATE = {"kimi-k25-int4-8gpu": 1.0, "llama31-8b-h100-eagle3": 10.0}
"""Mean rate of the bursty workload: quiet and busy periods (x10) around a mid load."""
BURSTY = ["--burst-factor", "10", "--burst-period", "60"]
TIE_WITHIN = 0.01  # plan's default --tie-within 1%
NAMES = {
    "baseline=2": "2x plain",
    "baseline=1,eagle=1": "pair",
    "eagle=2": "2x EAGLE",
    "adaptive=2": "2x adaptive",
}


@dataclass
class Row:
    profile: str
    load: str
    plain: dict[str, Any]
    pair: dict[str, Any]
    eagle: dict[str, Any] | None
    adaptive: dict[str, Any] | None
    best: list[str]
    """The best deployment and those tied with it (plan's labels)."""
    command: str


def plan_command(profile: str, workload: list[str], requests: int, seeds: list[int], out: Path) -> list[str]:
    return [
        "specroute", "plan", "--profile", profile, "--servers", "2", "--kinds", "baseline,eagle,adaptive",
        *workload, "--requests", str(requests), "--loads", "1", "--seeds", *map(str, seeds),
        "--out", str(out), "--json", "--no-progress",
    ]  # fmt: skip


def workloads(profile: str) -> list[tuple[str, list[str]]]:
    """(label, workload flags) for one profile."""
    out = [(f"{r:g}", ["--workload", "poisson", "--rate", f"{r:g}"]) for r in RATES.get(profile, (1.0,))]
    if profile in BURSTY_RATE:
        rate = f"{BURSTY_RATE[profile]:g}"
        out.append((f"{rate} bursty", ["--workload", "bursty", "--rate", rate, *BURSTY]))
    return out


def run_plan(argv: list[str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "controller.cli", *argv[1:]], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} failed:\n{proc.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def entry(ranking: list[dict[str, Any]], deployment: dict[str, int]) -> dict[str, Any] | None:
    return next((r for r in ranking if r["deployment"] == deployment), None)


def fmt_ci(e: dict[str, Any]) -> str:
    o = e["objective"]
    return f"{o['mean']:.2f} ±{(o['ci95_high'] - o['ci95_low']) / 2:.2f}"


def compare(row: Row) -> tuple[str, str]:
    """(pair vs two plain servers in %, with the paired CI; verdict)."""
    pair, plain = row.pair["objective"]["per_seed"], row.plain["objective"]["per_seed"]
    margin = paired_margin(pair, plain, higher_is_better=False, tie_within=TIE_WITHIN)
    base = row.plain["objective"]["mean"]
    # the margin is pair's advantage (positive: the pair is faster); show pair - plain
    diff, low, high = -margin.diff.mean, -margin.diff.high, -margin.diff.low
    text = f"{100 * diff / base:+.1f}% [{100 * low / base:+.1f}, {100 * high / base:+.1f}]"
    if margin.verdict == "tie":
        verdict = "tie"
    elif margin.verdict == "n/a":
        verdict = "n/a (one seed)"
    else:
        verdict = "pair faster" if diff < 0 else "2x plain faster"
    return text, verdict


def table(rows: list[Row], markdown: bool) -> str:
    head = ["profile", "mean req/s", "2x plain e2e s", "plain+EAGLE e2e s", "2x EAGLE e2e s",
            "2x adaptive e2e s", "pair vs 2x plain", "verdict", "pair's eagle share", "best"]  # fmt: skip
    body = []
    for r in rows:
        diff, verdict = compare(r)
        share = r.pair["summary"]["pool_share"]["eagle"]
        body.append(
            [r.profile, r.load, fmt_ci(r.plain), f"{fmt_ci(r.pair)} ({r.pair['policy']})",
             fmt_ci(r.eagle) if r.eagle else "-", fmt_ci(r.adaptive) if r.adaptive else "-", diff,
             verdict, f"{100 * share:.0f}%", " ~ ".join(NAMES.get(b, b) for b in r.best)]
        )  # fmt: skip
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip() for x in [head, *body]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", nargs="+", default=list(RATES), help="built-in profiles (default: both)")
    ap.add_argument("--requests", type=int, default=1000, help="requests per simulation (default 1000)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="plan's evaluation seeds")
    ap.add_argument(
        "--markdown", action="store_true", help="print the table as markdown (docs/when-specroute-helps.md's)"
    )
    args = ap.parse_args()
    rows: list[Row] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="specroute-helps-") as tmp:
        for profile in args.profiles:
            resolve_profile(profile)
            for label, workload in workloads(profile):
                argv = plan_command(profile, workload, args.requests, args.seeds, Path(tmp) / "plan.yaml")
                print(f"$ {shlex.join(argv)}", file=sys.stderr, flush=True)
                result = run_plan(argv)
                ranking = result["loads"][0]["ranking"]
                plain = entry(ranking, {"baseline": 2})
                pair = entry(ranking, {"baseline": 1, "eagle": 1})
                assert plain is not None and pair is not None, ranking
                eagle, adaptive = entry(ranking, {"eagle": 2}), entry(ranking, {"adaptive": 2})
                best = [result["loads"][0]["best"], *result["loads"][0]["tied_with_best"]]
                rows.append(Row(profile, label, plain, pair, eagle, adaptive, best, shlex.join(argv)))
    print(table(rows, args.markdown))
    n = len(args.seeds)
    print(
        f"\n{len(rows)} plans, {args.requests} requests per simulation, mean e2e ± 95% CI over {n} seeds; "
        f"pair vs 2x plain: paired difference [95% CI]; tie: inside its CI or under {100 * TIE_WITHIN:g}%; "
        "best: plan's best, ~ those tied with it; "
        f"{time.monotonic() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
