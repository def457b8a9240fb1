"""Proxy CPU per request as instructions: `specroute serve` under valgrind's callgrind, this tree
beside another checkout, on `proxy_overhead.py`'s backend and load.

Wall-clock CPU figures (`proxy_overhead.py`) move by 5-10% between rounds on a shared 2-core
machine; an instruction count does not (the same tree twice: within 0.2%), so a change of a
few percent shows. What it leaves out: the kernel's share (syscalls, page faults), which
`proxy_overhead.py` counts -- compare `strace -c` counts for that.

How: each tree's serve starts under `valgrind --tool=callgrind --instr-atstart=no`, gets a
warm-up of requests, then `callgrind_control -i on`, `--requests` requests at `--concurrency`
(closed loop, the 64-chunk streams of `proxy_overhead.py`), `callgrind_control -i off`, and
the instructions counted in between divided by the requests. Background work (health probes,
scrapes) during that window is counted too: ~3k instructions per request idle, 0.15%.
Each tree runs `--runs` times, alternating; printed: instructions per request per run, the
mean, and the ratio of the means.

    python benchmarks/proxy_instructions.py --compare-root /tmp/old [--requests 400]
        [--concurrency 16] [--runs 2]

Needs valgrind (Debian's `valgrind`: callgrind and callgrind_control). About 25 s per run.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

from controller.cli import spawn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_overhead  # noqa: E402  (the backend and the load of the wall-clock benchmark)


def _totals(out_prefix: str) -> int:
    """Instructions recorded in callgrind's output files (one per dump)."""
    total = 0
    for path in glob.glob(out_prefix + "*"):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
    return total


async def _drive(url: str, concurrency: int, n: int) -> int:
    async with aiohttp.ClientSession() as session:
        _, _, errors = await proxy_overhead.drive(session, url, concurrency, n)
    return errors


def run_once(root: Path, backend: tuple[str, str], args: argparse.Namespace, workdir: str) -> float:
    """Instructions per request of one serve from `root`."""
    base, eagle = backend
    out = os.path.join(workdir, f"cg.{os.getpid()}.{abs(hash(str(root)))}.out")
    for path in glob.glob(out + "*"):
        os.remove(path)
    cmd = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
        sys.executable, "-m", "controller.cli", "serve", "--port", "0", "--baseline", base,
        "--eagle", eagle, "--log-level", "ERROR", "--policy", "threshold", "--policy-param", "threshold=32",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root)}
    try:
        proc, line = spawn.start_sync(cmd, cwd=str(root), stderr=subprocess.DEVNULL, env=env, timeout_s=300)
    except spawn.StartError as e:
        raise SystemExit(f"serve from {root} did not start under valgrind: {e}") from None
    try:
        url = spawn.url_of(line)
        errors = asyncio.run(_drive(url, args.concurrency, max(50, args.requests // 4)))
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], capture_output=True, check=True)
        errors += asyncio.run(_drive(url, args.concurrency, args.requests))
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], capture_output=True, check=True)
        if errors:
            raise SystemExit(f"{errors} of the requests to serve from {root} failed")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    total = _totals(out)
    if total <= 0:
        raise SystemExit(f"callgrind recorded nothing for serve from {root}")
    return float(total / args.requests)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare-root", required=True, help="The other checkout (e.g. a `git worktree`).")
    ap.add_argument("--requests", type=int, default=400, help="Requests counted per run.")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2, help="Runs per tree, alternating.")
    args = ap.parse_args()
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: install Debian's valgrind")
    other = Path(args.compare_root).resolve()
    if not (other / "controller" / "cli").is_dir():
        raise SystemExit(f"{other} holds no specroute checkout (no controller/cli)")
    trees = {"this tree": ROOT, "compare-root": other}
    counts: dict[str, list[float]] = {name: [] for name in trees}
    be, line = spawn.start_sync(
        [sys.executable, str(Path(proxy_overhead.__file__).resolve()), "--role", "backend"], cwd=str(ROOT)
    )
    try:
        base, eagle = spawn.url_of(line).split()
        with tempfile.TemporaryDirectory(prefix="specroute-cg-") as workdir:
            for run in range(args.runs):
                order = list(trees) if run % 2 == 0 else list(reversed(trees))
                for name in order:
                    counts[name].append(run_once(trees[name], (base, eagle), args, workdir))
                    got = counts[name][-1]
                    print(f"  run {run + 1}/{args.runs} {name:<12} {got:,.0f} instructions/request")
    finally:
        be.terminate()
        be.wait(10)
    print(f"\n{args.requests} requests per run at concurrency {args.concurrency}, {args.runs} runs per tree")
    for name, xs in counts.items():
        spread = f" (range {min(xs):,.0f}-{max(xs):,.0f})" if len(xs) > 1 else ""
        print(f"  {name:<12} {statistics.fmean(xs):,.0f} instructions/request{spread}  [{trees[name]}]")
    ratio = statistics.fmean(counts["this tree"]) / statistics.fmean(counts["compare-root"])
    print(f"  this tree / compare-root: {ratio:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
