"""Simulator fidelity: the same sweep through the emulator and the real proxy, and simulated.

Live: two `specroute emulate` servers (baseline and eagle, from the profile) and
`specroute serve` in front of them with the policy under test, all as subprocesses; the sweep
is driven by `specroute bench`'s client (`controller.bench.runner.run_sweep`, streaming chat,
`ignore_eos`, so every request produces exactly `--max-tokens` tokens), one level at a time,
with the proxy's `specroute_requests_total` read between levels for the pool share.
Simulated: `specroute simulate`'s engine on the same profile, deployment (baseline=1,eagle=1),
policy and sweep (levels, requests per level, warm-up, output length), whose levels follow
the bench client's warm-up/measured/filler rule.

The emulators run at `--time-scale X` (wall seconds = profile seconds x X) so a sweep is
quick; live figures are converted back to profile time before the comparison (rates x X,
durations / X). Live overheads (proxy, HTTP, event-loop timer slack on a busy machine) are
therefore magnified by 1/X in the TTFT column.

Per level: mean per-request decode rate, total throughput and mean TTFT, live (with its 95%
interval and n) and simulated, and the relative difference (sim - live) / live. Target
(issue 5): within 10%.

    python benchmarks/sim_vs_live.py [--policy cost_model] [--levels 1 5 10 30]
        [--requests-per-level 30] [--time-scale 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from controller.bench.result import LevelSummary
from controller.bench.runner import run_sweep
from controller.cli import spawn
from policies.profile import resolve_profile
from policies.registry import PolicyContext, default_registry
from simulator.engine.deployment import ServerModel, build_deployment, parse_deployment
from simulator.engine.loop import NOT_SENT, RawRun, simulate
from simulator.engine.results import samples, summarize
from simulator.engine.workloads import LengthSpec, WorkloadSpec, generate

TARGET = 0.10


class Proc:
    """A `specroute` subprocess, started by the shared spawn helper (`controller.cli.spawn`)."""

    def __init__(self, args: list[str], marker: str) -> None:
        self.args = args
        # stderr goes to a file: an unread pipe would fill up and stall the server.
        self.log = tempfile.TemporaryFile(mode="w+")
        try:
            self.proc, line = spawn.start_sync(
                [sys.executable, "-m", "controller.cli", *args], marker=marker, stderr=self.log, timeout_s=30
            )
        except spawn.StartError as e:
            self.log.seek(0)
            tail = self.log.read()[-2000:]
            self.log.close()
            raise RuntimeError(f"specroute {' '.join(args)}: {e}; stderr:\n{tail}") from None
        self.url = spawn.url_of(line, marker)

    def stop(self) -> None:
        spawn.stop_sync(self.proc)
        self.log.close()


@contextlib.contextmanager
def live_stack(
    profile: str, policy: str, scale: float, seed: int, decision_log: str | None = None
) -> Iterator[str]:
    procs: list[Proc] = []
    try:
        common = ["--profile", profile, "--port", "0", "--time-scale", str(scale), "--seed", str(seed)]
        base = Proc(["emulate", "--mode", "baseline", *common], "listening on")
        procs.append(base)
        eagle = Proc(["emulate", "--mode", "eagle", *common], "listening on")
        procs.append(eagle)
        proxy = Proc(
            ["serve", "--baseline", base.url, "--eagle", eagle.url, "--policy", policy, "--profile", profile,
             "--port", "0", "--seed", str(seed),
             *(["--decision-log", decision_log] if decision_log else [])],
            "listening on",
        )  # fmt: skip
        procs.append(proxy)
        yield proxy.url
    finally:
        for p in reversed(procs):
            p.stop()


def pool_counts(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    counts = {"baseline": 0.0, "eagle": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "specroute_requests_total" and s.labels.get("pool") in counts:
                counts[s.labels["pool"]] += s.value
    return counts


async def live_levels(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for c in args.levels:
        before = pool_counts(url)
        result = await run_sweep(
            url,
            levels=(c,),
            requests_per_level=args.requests_per_level,
            warmup=args.warmup,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            progress=True,
        )
        after = pool_counts(url)
        out.append(live_figures(c, result.levels[0].summary, args.time_scale, before, after))
    return out


def live_figures(
    c: int, s: LevelSummary, x: float, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    """A live level's figures in profile time (emulator time scale `x`); the eagle share from the
    pool counts before and after it."""
    sent = sum(after.values()) - sum(before.values())
    print(f"live level {c}: done ({s.n} measured, {s.errors} errors)", file=sys.stderr)
    return {
        "concurrency": c,
        "n": s.n,
        "errors": s.errors,
        "decode": (s.decode_tok_s.mean * x, (s.decode_tok_s.half_width or 0.0) * x)
        if s.decode_tok_s
        else None,
        "total": (s.total_tok_s.mean * x, (s.total_tok_s.half_width or 0.0) * x) if s.total_tok_s else None,
        "ttft": (s.ttft_s.mean / x, (s.ttft_s.half_width or 0.0) / x) if s.ttft_s else None,
        "eagle_share": (after["eagle"] - before["eagle"]) / sent if sent else float("nan"),
    }


def sim_figures(servers: Sequence[ServerModel], raw: RawRun, concurrency: int | None) -> dict[str, Any]:
    """A simulated level's figures (the eagle share over every request it sent)."""
    s = summarize([samples(raw)])
    sent = [i for i, ph in enumerate(raw.phase) if ph != NOT_SENT]
    eagle = sum(1 for i in sent if servers[raw.server[i]].pool == "eagle")
    return {
        "concurrency": concurrency,
        "n": s["requests"],
        "decode": s["mean_decode_tok_s"],
        "total": s["throughput_tok_s"],
        "ttft": s["mean_ttft_s"],
        "eagle_share": eagle / len(sent),
    }


def simulated_levels(args: argparse.Namespace) -> list[dict[str, Any]]:
    profile = resolve_profile(args.profile)
    spec = WorkloadSpec(
        kind="sweep",
        levels=tuple(args.levels),
        requests_per_level=args.requests_per_level,
        warmup=args.warmup,
        output_tokens=LengthSpec("const", args.max_tokens),
    )
    servers = build_deployment(profile, parse_deployment("baseline=1,eagle=1"))
    policy = default_registry().create(args.policy, {}, PolicyContext(profile, args.seed))
    out = []
    for k, seg in enumerate(generate(spec, args.seed)):
        raw = simulate(
            servers, policy, seg.batch, concurrency=seg.concurrency, warmup=seg.warmup, measure=seg.measure,
            seed=args.seed * 1000 + k,
        )  # fmt: skip
        out.append(sim_figures(servers, raw, seg.concurrency))
    return out


def comparison_table(live: list[dict[str, Any]], sim: list[dict[str, Any]]) -> float:
    """Print live and simulated levels side by side; the worst |diff| of decode rate and total
    throughput."""
    header = (
        f"{'conc':>4} {'n':>3} | {'decode live (95% CI)':>22} {'sim':>7} {'diff':>7} | "
        f"{'total live (95% CI)':>22} {'sim':>7} {'diff':>7} | "
        f"{'TTFT live s (95% CI)':>22} {'sim':>6} {'diff':>7} | "
        f"{'eagle% live':>11} {'sim':>5}"
    )
    print(header)
    worst = 0.0
    for lv, sv in zip(live, sim, strict=True):
        cells = []
        for key, width, fmt in (("decode", 7, "{:7.1f}"), ("total", 7, "{:7.1f}"), ("ttft", 6, "{:6.3f}")):
            got = lv[key]
            if got is None or sv[key] is None:
                cells.append(f"{'-':>22} {'-':>{width}} {'-':>7}")
                continue
            mean, hw = got
            diff = (sv[key] - mean) / mean
            if key != "ttft":
                worst = max(worst, abs(diff))
            live_s = f"{fmt.format(mean).strip()} ± {fmt.format(hw).strip()}"
            cells.append(f"{live_s:>22} {fmt.format(sv[key])} {100 * diff:+6.1f}%")
        print(
            f"{lv['concurrency']:>4} {lv['n']:>3} | " + " | ".join(cells)
            + f" | {100 * lv['eagle_share']:>11.0f} {100 * sv['eagle_share']:>5.0f}"
        )  # fmt: skip
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="kimi-k25-int4-8gpu")
    ap.add_argument("--policy", default="cost_model")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 5, 10, 30])
    ap.add_argument("--requests-per-level", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument(
        "--time-scale", type=float, default=0.25, help="Emulator time scale (wall = profile x X)."
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decision-log", help="Also write the proxy's decision log here (JSONL; replayable).")
    args = ap.parse_args()

    sim = simulated_levels(args)
    t0 = time.monotonic()
    with live_stack(args.profile, args.policy, args.time_scale, args.seed, args.decision_log) as url:
        live = asyncio.run(live_levels(url, args))
    wall = time.monotonic() - t0

    print(
        f"sim vs live: profile {args.profile!r}, policy {args.policy}, baseline=1,eagle=1, "
        f"{args.requests_per_level} measured + {args.warmup} warm-up requests/level, "
        f"{args.max_tokens} tokens each; emulator time scale {args.time_scale:g} (live figures converted "
        f"to profile time); live run {wall:.0f} s; {os.cpu_count()} CPUs"
    )
    worst = comparison_table(live, sim)
    print(
        f"\nworst |diff| of decode rate and total throughput: {100 * worst:.1f}% "
        f"(target {100 * TARGET:.0f}%); eagle% counts every request of the level (warm-up and fillers too)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
