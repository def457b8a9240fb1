"""Three live specroute replicas against the simulator's prediction for three routers.

Live: two `specroute emulate` servers (baseline and eagle, from the profile) and three
`specroute serve` processes in front of both (the policy under test, scrape every 1 s, the
`replicas` setting as given), all subprocesses. Each concurrency level runs a third of its
closed-loop clients against each replica (`specroute bench`'s client, streaming chat,
`ignore_eos`), as clients held on keep-alive connections to one replica behind a Kubernetes
Service would; the three replicas' measured requests are summarised together. Pool shares
come from the replicas' `specroute_requests_total`, summed.
Simulated: the same profile, deployment, policy and sweep with `--routers 3` (arrivals
round-robin over the routers, scrape every 1 s at each router's own phase, the same
`replicas` setting).

The emulators run at `--time-scale X`; live figures are converted back to profile time
(see `benchmarks/sim_vs_live.py`, whose tolerance applies: decode rate and total throughput
within 10%).

    python benchmarks/replicas_live.py [--policy cost_model] [--levels 6 15 30]
        [--requests-per-level 30] [--time-scale 0.25] [--replicas-setting 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_vs_live import TARGET, Proc, comparison_table, live_figures, pool_counts, sim_figures

from controller.bench.result import summarize as summarize_live
from controller.bench.runner import run_sweep
from policies.profile import resolve_profile
from policies.registry import PolicyContext, default_registry
from simulator.engine.deployment import build_deployment, parse_deployment
from simulator.engine.loop import simulate
from simulator.engine.replica_views import RouterGroup, RouterSetup
from simulator.engine.workloads import LengthSpec, WorkloadSpec, generate

REPLICAS = 3


@contextlib.contextmanager
def live_replicas(args: argparse.Namespace) -> Iterator[list[str]]:
    procs: list[Proc] = []
    try:
        common = ["--profile", args.profile, "--port", "0", "--time-scale", str(args.time_scale),
                  "--seed", str(args.seed)]  # fmt: skip
        base = Proc(["emulate", "--mode", "baseline", *common], "listening on")
        procs.append(base)
        eagle = Proc(["emulate", "--mode", "eagle", *common], "listening on")
        procs.append(eagle)
        urls = []
        for _ in range(REPLICAS):
            proxy = Proc(
                ["serve", "--baseline", base.url, "--eagle", eagle.url, "--policy", args.policy,
                 "--profile", args.profile, "--port", "0", "--seed", str(args.seed),
                 "--replicas", str(args.replicas_setting), "--log-level", "WARNING"],
                "listening on",
            )  # fmt: skip
            procs.append(proxy)
            urls.append(proxy.url)
        yield urls
    finally:
        for p in reversed(procs):
            p.stop()


def _counts(urls: list[str]) -> dict[str, float]:
    total = {"baseline": 0.0, "eagle": 0.0}
    for url in urls:
        for pool, v in pool_counts(url).items():
            total[pool] += v
    return total


async def live_levels(urls: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    x = args.time_scale
    for c in args.levels:
        before = _counts(urls)
        results = await asyncio.gather(
            *(
                run_sweep(
                    url,
                    levels=(c // REPLICAS,),
                    requests_per_level=args.requests_per_level // REPLICAS,
                    warmup=max(1, args.warmup // REPLICAS),
                    max_tokens=args.max_tokens,
                    ignore_eos=True,
                )
                for url in urls
            )
        )
        after = _counts(urls)
        s = summarize_live(c, [r for res in results for r in res.levels[0].requests])
        out.append(live_figures(c, s, x, before, after))
    return out


def simulated_levels(args: argparse.Namespace) -> list[dict[str, Any]]:
    profile = resolve_profile(args.profile)
    per = REPLICAS * (args.requests_per_level // REPLICAS)
    spec = WorkloadSpec(
        kind="sweep",
        levels=tuple(args.levels),
        requests_per_level=per,
        warmup=REPLICAS * max(1, args.warmup // REPLICAS),
        output_tokens=LengthSpec("const", args.max_tokens),
    )
    servers = build_deployment(profile, parse_deployment("baseline=1,eagle=1"))
    registry = default_registry()
    policies = [registry.create(args.policy, {}, PolicyContext(profile, args.seed)) for _ in range(REPLICAS)]
    group = RouterGroup(RouterSetup(REPLICAS, 1.0, "round-robin", float(args.replicas_setting)), policies)
    out = []
    for k, seg in enumerate(generate(spec, args.seed)):
        raw = simulate(
            servers, None, seg.batch, concurrency=seg.concurrency, warmup=seg.warmup, measure=seg.measure,
            seed=args.seed * 1000 + k, routers=group,
        )  # fmt: skip
        out.append(sim_figures(servers, raw, seg.concurrency))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="kimi-k25-int4-8gpu")
    ap.add_argument("--policy", default="cost_model")
    ap.add_argument("--levels", type=int, nargs="+", default=[6, 15, 30], help="Multiples of 3.")
    ap.add_argument("--requests-per-level", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument(
        "--time-scale", type=float, default=0.25, help="Emulator time scale (wall = profile x X)."
    )
    ap.add_argument("--replicas-setting", type=int, default=1, help="serve's replicas setting (1: off).")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if any(c % REPLICAS for c in args.levels):
        ap.error(f"--levels must be multiples of {REPLICAS}")

    sim = simulated_levels(args)
    t0 = time.monotonic()
    with live_replicas(args) as urls:
        live = asyncio.run(live_levels(urls, args))
    wall = time.monotonic() - t0

    print(
        f"replicas live vs sim: {REPLICAS} serve replicas, profile {args.profile!r}, policy {args.policy}, "
        f"replicas setting {args.replicas_setting}, baseline=1,eagle=1, {args.requests_per_level} measured + "
        f"{args.warmup} warm-up requests/level (a third per replica), {args.max_tokens} tokens each; "
        f"emulator time scale {args.time_scale:g} (live figures in profile time); live run {wall:.0f} s; "
        f"{os.cpu_count()} CPUs"
    )
    worst = comparison_table(live, sim)
    verdict = "met" if worst <= TARGET else "MISSED"
    print(
        f"\nworst |diff| of decode rate and total throughput: {100 * worst:.1f}% "
        f"(target {100 * TARGET:.0f}%, as sim_vs_live): {verdict}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
