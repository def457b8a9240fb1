"""Reference runs of the simulator: record their JSON once, then check a changed engine against it.

A fixed set of `specroute simulate ... --json` runs covering every workload (sweep, poisson,
bursty, Azure code/conv traces, multiturn, Mooncake), several routers, prefix caches, the oracle
and several policies. `--record DIR` writes one JSON per run; `--check DIR` reruns them and
compares the documents bit for bit (every float as printed), listing the runs that differ.

    python benchmarks/simulator_reference.py --record /tmp/ref      # before a change
    python benchmarks/simulator_reference.py --check /tmp/ref       # after it
    python benchmarks/simulator_reference.py --check /tmp/ref --engine native   # the mypyc build

`--engine` (default python) says which simulator runs: the pure Python, or the compiled build
(`specroute native build`; `simulator.native`), which must give the same documents to the bit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TRACES = Path("/work/shared/data/traces")
P = ["--profile", "kimi-k25-int4-8gpu"]
RUNS: dict[str, list[str]] = {
    "sweep_threshold_cost": [
        *P,
        "--workload",
        "sweep",
        "--concurrency",
        "1",
        "5",
        "30",
        "100",
        "--policy",
        "threshold",
        "--policy",
        "cost_model",
    ],
    "sweep_oracle": [
        *P,
        "--workload",
        "sweep",
        "--concurrency",
        "1",
        "10",
        "70",
        "--oracle",
        "--policy",
        "cost_model",
        "--policy",
        "online",
    ],
    "poisson_many": [
        *P,
        "--workload",
        "poisson",
        "--rate",
        "3",
        "--requests",
        "3000",
        "--output-tokens",
        "exp:200",
        "--policy",
        "cost_model",
        "--policy",
        "online",
        "--policy",
        "threshold",
        "--policy",
        "round_robin",
        "--policy",
        "fixed",
        "--spec-details",
        "--accept-sigma",
        "0.3",
    ],
    "poisson_llama": [
        "--profile",
        "llama31-8b-h100-eagle3",
        "--workload",
        "poisson",
        "--rate",
        "20",
        "--requests",
        "3000",
        "--policy",
        "cost_model",
        "--policy",
        "cache_only",
        "--deployment",
        "baseline=2,eagle=1",
        "--deployment",
        "baseline=1,adaptive=1",
    ],
    "bursty": [
        *P,
        "--workload",
        "bursty",
        "--rate",
        "2",
        "--requests",
        "3000",
        "--burst-factor",
        "10",
        "--burst-period",
        "60",
        "--policy",
        "cost_model",
        "--policy",
        "online",
        "--hint-mix",
        "code=0.3,prose=0.7",
        "--hint-accept",
        "code=1.2,prose=0.85",
    ],
    "trace_code": [
        *P,
        "--workload",
        "trace",
        "--trace",
        str(TRACES / "AzureLLMInferenceTrace_code.csv"),
        "--requests",
        "3000",
        "--time-scale",
        "4",
        "--policy",
        "cost_model",
        "--policy",
        "threshold",
    ],
    "trace_conv": [
        *P,
        "--workload",
        "trace",
        "--trace",
        str(TRACES / "AzureLLMInferenceTrace_conv.csv"),
        "--requests",
        "3000",
        "--time-scale",
        "2",
        "--policy",
        "cost_model",
        "--policy",
        "online",
    ],
    "multiturn": [
        *P,
        "--workload",
        "multiturn",
        "--rate",
        "1",
        "--requests",
        "1500",
        "--policy",
        "cost_model",
        "--policy",
        "cache_only",
        "--policy",
        "threshold",
    ],
    "multiturn_small_cache": [
        *P,
        "--workload",
        "multiturn",
        "--rate",
        "1",
        "--requests",
        "1500",
        "--cache-tokens",
        "20000",
        "--deployment",
        "baseline=2,eagle=2",
        "--policy",
        "cost_model",
        "--policy",
        "cache_only",
    ],
    "mooncake": [
        *P,
        "--workload",
        "trace",
        "--trace",
        str(TRACES / "mooncake_conversation_trace.jsonl"),
        "--requests",
        "2000",
        "--policy",
        "cost_model",
        "--policy",
        "cache_only",
    ],
    "routers2": [
        *P,
        "--workload",
        "poisson",
        "--rate",
        "3",
        "--requests",
        "3000",
        "--routers",
        "2",
        "--policy",
        "cost_model",
        "--policy",
        "online",
        "--deployment",
        "baseline=2,eagle=1",
    ],
    "routers3_rr": [
        *P,
        "--workload",
        "poisson",
        "--rate",
        "3",
        "--requests",
        "3000",
        "--routers",
        "3",
        "--router-split",
        "round-robin",
        "--scrape-interval",
        "2",
        "--replicas-setting",
        "3",
        "--policy",
        "cost_model",
        "--policy",
        "threshold",
    ],
    "routers2_multiturn": [
        *P,
        "--workload",
        "multiturn",
        "--rate",
        "1",
        "--requests",
        "1500",
        "--routers",
        "2",
        "--policy",
        "cost_model",
        "--policy",
        "cache_only",
        "--deployment",
        "baseline=2,eagle=2",
    ],
    "routers1_scrape": [
        *P,
        "--workload",
        "poisson",
        "--rate",
        "3",
        "--requests",
        "2000",
        "--scrape-interval",
        "1",
        "--policy",
        "cost_model",
    ],
    "routers2_sweep": [
        *P,
        "--workload",
        "sweep",
        "--concurrency",
        "5",
        "50",
        "--routers",
        "2",
        "--policy",
        "cost_model",
    ],
    "saturated": [
        *P,
        "--workload",
        "poisson",
        "--rate",
        "8",
        "--requests",
        "3000",
        "--policy",
        "cost_model",
        "--policy",
        "online",
        "--policy",
        "threshold",
    ],
    "server_speed": [
        *P,
        "--workload",
        "poisson",
        "--rate",
        "2",
        "--requests",
        "2000",
        "--server-speed",
        "eagle=0.8",
        "--spec-details",
        "--policy",
        "cost_model",
        "--policy",
        "online",
    ],
}


def child(engine: str, args: list[str]) -> int:
    """`specroute simulate ARGS --json`, plus a digest of every simulated request's times, server
    and cache hit (the JSON only holds summaries) as the document's last line."""
    import hashlib

    from simulator import native

    if engine == "native":
        status = native.activate()
        if not status.active:
            raise SystemExit(f"--engine native: {status.reason}")

    import simulator.engine.runner as runner
    from controller.cli import main as cli_main

    digest = hashlib.sha256()
    inner = runner.simulate  # type: ignore[attr-defined]  # (wrapped where the runner calls it)

    def recorded(*a: Any, **k: Any) -> Any:
        raw = inner(*a, **k)
        for column in (raw.arrival, raw.first_token, raw.finish, raw.server, raw.phase, raw.cached_tokens):
            digest.update(repr(list(column) if column is not None else None).encode())
        return raw

    runner.simulate = recorded  # type: ignore[attr-defined]
    try:
        rc = cli_main(["simulate", *args, "--json"])
    except SystemExit as e:
        rc = int(e.code or 0)
    sys.stdout.flush()
    print(json.dumps({"raw_digest": digest.hexdigest()}))
    return rc or 0


def run(engine: str, args: list[str]) -> str:
    cmd = [sys.executable, __file__, "--child", engine, *args]
    env = {**os.environ, "SPECROUTE_NATIVE": "1" if engine == "native" else "0"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return out.stdout


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--record", type=Path)
    g.add_argument("--check", type=Path)
    ap.add_argument("--only", nargs="*", help="Run only these names.")
    ap.add_argument(
        "--engine",
        choices=("python", "native"),
        default="python",
        help="The pure-Python simulator or its compiled build (`specroute native build`).",
    )
    args = ap.parse_args()
    names = args.only or list(RUNS)
    bad = 0
    for name in names:
        t = time.perf_counter()
        text = run(args.engine, RUNS[name])
        secs = time.perf_counter() - t
        if args.record:
            args.record.mkdir(parents=True, exist_ok=True)
            (args.record / f"{name}.json").write_text(text)
            print(f"recorded {name} ({secs:.1f} s)")
            continue
        want = (args.check / f"{name}.json").read_text()
        same = want == text
        bad += not same
        print(f"{'identical' if same else 'DIFFERS  '} {name} ({secs:.1f} s)")
        if not same:
            (args.check / f"{name}.new.json").write_text(text)
    if args.check:
        print(f"{len(names) - bad}/{len(names)} identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
