"""Simulator speed: simulated requests per second of wall time, on one core.

Workload: open-loop Poisson arrivals, exponential output lengths, one baseline and one eagle
server from the kimi profile; the policy under test routes every request (building the same
`LoadView`/`RequestInfo` objects as the proxy and receiving every `Outcome`). The engine alone
(least-loaded routing, no policy objects) is measured side by side to show what the policy
path costs. Workload generation is not timed (it is done once, before the repeats).

    python benchmarks/simulator_speed.py                 # 1M requests, cost_model, 3 repeats
    python benchmarks/simulator_speed.py --requests 200000 --repeats 5 --policies threshold
    git archive main | tar -x -C /tmp/main-tree
    python benchmarks/simulator_speed.py --against /tmp/main-tree   # this tree beside another

With a compiled build of this tree (`specroute native build`, see `simulator.native`) the pure
Python and the build are timed side by side (`--engine both`, the default): each repeat runs
once in a fresh process per engine. With `--against DIR` each repeat runs once in a fresh
process per tree (this one, then DIR's code with the same driver, rotating which goes first),
so both figures come from the same run on the same machine state; the ratio is the figure to
trust on a shared machine.

Targets: issue 5, 200,000 simulated requests per second with `cost_model`; issue 23, 150,000.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# the source tree measured: `--tree DIR` (a child run of `--against`), else this one
sys.path.insert(
    0,
    sys.argv[sys.argv.index("--tree") + 1]
    if "--tree" in sys.argv
    else str(Path(__file__).resolve().parents[1]),
)

if "--child" in sys.argv and sys.argv[sys.argv.index("--engine") + 1] == "native":
    # the compiled build must be loaded before anything of the simulator is imported
    from simulator import native

    _status = native.activate()
    if not _status.active:
        raise SystemExit(f"--engine native: {_status.reason}")

from policies.base import Decision, LoadView, Outcome, Policy, RequestInfo
from policies.params import parse_policy_ref
from policies.profile import resolve_profile
from policies.registry import PolicyContext, PolicyRegistry, default_registry
from simulator.engine.loop import simulate
from simulator.engine.workloads import LengthSpec, WorkloadSpec, generate

try:
    from simulator.engine.deployment import build_deployment, parse_deployment
except ImportError:  # an --against tree from before the module's rename (it was `servers`)
    from simulator.engine.servers import build_deployment, parse_deployment  # type: ignore[import-not-found, no-redef]

TARGET = 200_000.0


def _tree() -> str:
    return sys.path[0]


class Timed:
    """Wraps a policy and adds up the wall time spent inside choose() and observe()."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.seconds = 0.0

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        t = time.perf_counter()
        d = self.inner.choose(request, view, now)
        self.seconds += time.perf_counter() - t
        return d

    def observe(self, outcome: Outcome) -> None:
        t = time.perf_counter()
        self.inner.observe(outcome)
        self.seconds += time.perf_counter() - t


def create(registry: PolicyRegistry, ref: str, context: PolicyContext) -> Policy:
    """A policy from `NAME` or `NAME:KEY=VALUE,...`."""
    name, params = parse_policy_ref(ref)
    return registry.create(name, params or {}, context)


def pin_one_core() -> str:
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no sched_setaffinity)"
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return f"pinned to CPU {cpu}"


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--rate", type=float, default=4.0, help="Arrivals per second (default 4: ~40%% eagle).")
    ap.add_argument("--output-tokens", default="exp:200")
    ap.add_argument(
        "--policies",
        nargs="+",
        default=["cost_model"],
        help="Policies to time, NAME or NAME:KEY=VALUE,... (default cost_model).",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", default="kimi-k25-int4-8gpu")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--against",
        type=Path,
        help="Also time the source tree DIR (e.g. an archive of main), alternating fresh processes.",
    )
    ap.add_argument(
        "--engine",
        choices=("python", "native", "both"),
        default="both",
        help="The pure-Python simulator, its compiled build (`specroute native build`), or both side "
        "by side in fresh processes (default both; python alone when no build exists).",
    )
    ap.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


def _workload(args: argparse.Namespace) -> tuple[Any, list[Any], float]:
    profile = resolve_profile(args.profile)
    spec = WorkloadSpec(
        kind="poisson",
        rate=args.rate,
        requests=args.requests,
        output_tokens=LengthSpec.parse(args.output_tokens),
    )
    t0 = time.perf_counter()
    batch = generate(spec, args.seed)[0].batch
    gen_s = time.perf_counter() - t0
    return profile, [batch, build_deployment(profile, parse_deployment("baseline=1,eagle=1"))], gen_s


def _one(
    name: str, args: argparse.Namespace, profile: Any, batch: Any, servers: Any, seed: int
) -> tuple[float, float, float, float]:
    """One timed run of `name` (or the engine alone): (wall s, cpu s, simulated s, eagle share)."""
    policy = None
    if not name.startswith("("):
        policy = create(default_registry(), name, PolicyContext(profile, args.seed))
    gc.collect()
    t, c = time.perf_counter(), time.process_time()
    raw = simulate(servers, policy, batch, seed=seed)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    share = sum(1 for s in raw.server if servers[s].pool == "eagle") / args.requests
    return wall, cpu, max(raw.finish), share


def _child(args: argparse.Namespace) -> int:
    """One repeat of every policy in this process; prints {name: [wall, cpu, simulated, share]}."""
    profile, (batch, servers), _ = _workload(args)
    out = {name: _one(name, args, profile, batch, servers, args.seed) for name in args.policies}
    print(json.dumps(out))
    return 0


def _variants(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(label, source tree, engine) of every figure: this tree's engines, then `--against`'s."""
    from simulator import native

    engines = ["python", "native"] if args.engine == "both" else [args.engine]
    if args.engine == "both" and native.find() is None:
        print("no compiled build of this tree (`specroute native build` makes one): timing pure Python only")
        engines = ["python"]
    out = [(f"this/{e}", _tree(), e) for e in engines]
    if args.against is not None:  # the same engines (a native one needs that tree's own build)
        out += [(f"against/{e}", str(args.against.resolve()), e) for e in engines]
    return out


def _against(args: argparse.Namespace, where: str, variants: list[tuple[str, str, str]]) -> int:
    """Every variant, one fresh process per (repeat, variant), the order rotating by repeat."""
    print(
        f"simulator speed: {args.requests:,} requests, Poisson {args.rate:g}/s, output {args.output_tokens}, "
        f"baseline=1,eagle=1, profile {args.profile!r}; {where}; python {sys.version.split()[0]}"
    )
    for label, tree, engine in variants:
        print(f"  {label:<12} {engine:<7} {tree}")
    labels = [v[0] for v in variants]
    names = ["(engine alone)", *args.policies]
    runs: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    for rep in range(args.repeats):
        k = rep % len(variants)
        for label, tree, engine in variants[k:] + variants[:k]:
            cmd = [sys.executable, __file__, "--child", "--tree", tree, "--engine", engine,
                   "--requests", str(args.requests), "--rate", str(args.rate),
                   "--output-tokens", args.output_tokens, "--profile", args.profile,
                   "--seed", str(args.seed), "--policies", *names]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": tree}
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
            for name, row in json.loads(done.stdout.strip().splitlines()[-1]).items():
                runs.setdefault((label, name), []).append(tuple(row))
    print(
        f"\n{'variant':<12} {'policy':<16} {'n':>3} {'median req/s':>13} {'min':>10} {'max':>10} "
        f"{'cpu req/s':>10} {'eagle %':>8} {'vs 150k':>8}"
    )
    medians: dict[tuple[str, str], tuple[float, float]] = {}
    for name in names:
        for label in labels:
            rows = runs[(label, name)]
            rates = [args.requests / r[0] for r in rows]
            cpu = statistics.median(args.requests / r[1] for r in rows)
            med = statistics.median(rates)
            medians[(label, name)] = (med, cpu)
            print(
                f"{label:<12} {name:<16} {len(rates):>3} {med:>13,.0f} {min(rates):>10,.0f} "
                f"{max(rates):>10,.0f} {cpu:>10,.0f} {100 * rows[-1][3]:>8.1f} {med / 150_000:>7.2f}x"
            )
    first = labels[0]
    print(f"\neach variant / {first}, an --against one / this tree's on its engine (median wall, cpu):")
    for name in names:
        for label in labels[1:]:
            engine = label.rpartition("/")[2]
            base = f"this/{engine}" if label.startswith("against/") and f"this/{engine}" in labels else first
            (w0, c0), (w1, c1) = medians[(base, name)], medians[(label, name)]
            print(f"  {name:<16} {label:<15} / {base:<12} {w1 / w0:.3f}x wall, {c1 / c0:.3f}x cpu")
    same = all(runs[(label, n)][0][2:] == runs[(first, n)][0][2:] for n in names for label in labels)
    print(f"simulated seconds and eagle share equal in every variant: {same}")
    print(f"\nn = repeats of {args.requests:,} requests each, one fresh process per (repeat, variant).")
    return 0


def main() -> int:
    args = _args()
    where = pin_one_core()
    if args.child:
        return _child(args)
    variants = _variants(args)
    if len(variants) > 1 or variants[0][2] == "native":
        return _against(args, where, variants)
    profile, (batch, servers), gen_s = _workload(args)
    registry = default_registry()
    print(
        f"simulator speed: {args.requests:,} requests, Poisson {args.rate:g}/s, output {args.output_tokens}, "
        f"baseline=1,eagle=1, profile {args.profile!r}; {where}; python {sys.version.split()[0]}"
    )
    print(f"workload generation (not in the figures below): {gen_s:.2f} s")

    rows = []
    breakdown: list[str] = []
    for name in ["(engine alone)", *args.policies]:
        rates: list[float] = []
        cpu_rates: list[float] = []
        sim_ratio = 0.0
        share = 0.0
        for rep in range(args.repeats):
            wall, cpu, simulated, share = _one(name, args, profile, batch, servers, args.seed + rep)
            rates.append(args.requests / wall)
            cpu_rates.append(args.requests / cpu)
            sim_ratio = simulated / wall
        rows.append((name, rates, cpu_rates, sim_ratio, share))
        if not name.startswith("("):
            timed = Timed(create(registry, name, PolicyContext(profile, args.seed)))
            t = time.perf_counter()
            simulate(servers, timed, batch, seed=args.seed)
            wall = time.perf_counter() - t
            per = 1e6 / args.requests
            breakdown.append(
                f"{name}: {wall * per:.2f} us/request in total, of which {timed.seconds * per:.2f} us "
                "in the policy's choose()+observe() (timer overhead included) and "
                f"{(wall - timed.seconds) * per:.2f} us in the engine (events, load views, outcomes)"
            )

    width = max(16, *(len(r[0]) for r in rows))
    print(
        f"\n{'policy':<{width}} {'n':>3} {'median req/s':>13} {'min':>10} {'max':>10} {'cpu req/s':>10} "
        f"{'x real time':>12} {'eagle %':>8} {'vs target':>10}"
    )
    for name, rates, cpu_rates, ratio, share in rows:
        med, cpu_med = statistics.median(rates), statistics.median(cpu_rates)
        print(
            f"{name:<{width}} {len(rates):>3} {med:>13,.0f} {min(rates):>10,.0f} {max(rates):>10,.0f} "
            f"{cpu_med:>10,.0f} {ratio:>12,.0f} {100 * share:>8.1f} {med / TARGET:>9.2f}x"
        )
    print("\nwhere the time goes (one extra timed run each):")
    for line in breakdown:
        print("  " + line)
    print(
        f"\nn = repeats of {args.requests:,} requests each; target {TARGET:,.0f} req/s of wall time; "
        "'cpu req/s' = median over the same repeats per second of this process's CPU time (on a shared "
        "machine wall time also counts time spent waiting for the core); "
        "'x real time' = simulated seconds per wall second (last repeat)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
