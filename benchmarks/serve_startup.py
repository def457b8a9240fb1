"""`specroute serve` start-up: wall time from exec to the 'listening' line, resident memory once
listening, and which modules it imported.

The backends need not exist (the health probes just fail). Runs `python -m controller.cli serve`
from the checkout given (default: this one), so two checkouts can be compared in one run:

    python benchmarks/serve_startup.py                       # this checkout, 10 starts
    python benchmarks/serve_startup.py --tree /path/to/other --tree .   # side by side

Each start is a fresh process; the starts of the trees alternate, so a slow moment of a shared
machine hits both alike. Figures: median, min and max over the starts; RSS from /proc (Linux).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from controller.cli import spawn

HERE = Path(__file__).resolve().parent.parent
HEAVY = ("simulator", "tqdm", "matplotlib")
SERVE = ["serve", "--baseline", "http://127.0.0.1:9", "--eagle", "http://127.0.0.1:10", "--port", "0",
         "--policy", "cost_model", "--profile", "kimi-k25-int4-8gpu"]  # fmt: skip


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def start(tree: Path, importtime: bool = False) -> tuple[float, int, list[str]]:
    """(seconds to 'listening', RSS kB once listening, modules imported if `importtime`)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tree)}
    flags = ["-X", "importtime"] if importtime else []
    t0 = time.perf_counter()
    try:
        cmd = [sys.executable, *flags, "-m", "controller.cli", *SERVE]
        proc, _ = spawn.start_sync(cmd, cwd=str(tree), env=env)
    except spawn.StartError as e:
        raise SystemExit(f"{tree}: serve did not start: {e}") from None
    took = time.perf_counter() - t0
    time.sleep(0.3)  # let the first health probes and scrapes run
    rss = rss_kb(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    modules = [ln.rsplit("|", 1)[-1].strip() for ln in err.splitlines() if ln.startswith("import time:")]
    return took, rss, modules[1:]  # the first line is the header


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", type=Path, help="checkout to run (repeat to compare)")
    ap.add_argument("--runs", type=int, default=10, help="starts per checkout (default 10)")
    args = ap.parse_args()
    trees = [t.resolve() for t in (args.tree or [HERE])]
    times: dict[Path, list[float]] = {t: [] for t in trees}
    rss: dict[Path, list[int]] = {t: [] for t in trees}
    for _ in range(args.runs):
        for t in trees:
            took, kb, _ = start(t)
            times[t].append(took)
            rss[t].append(kb)
    print(f"specroute serve start-up, n = {args.runs} starts per checkout (alternating)")
    head = f"{'checkout':<40} {'to listening ms: median (min-max)':>34} {'RSS MB: median (min-max)':>27}"
    print(head + "  modules")
    for t in trees:
        _, _, modules = start(t, importtime=True)
        heavy = sorted({m.split(".")[0] for m in modules if m.split(".")[0] in HEAVY})
        ms = [1000 * x for x in times[t]]
        mb = [x / 1024 for x in rss[t]]
        print(
            f"{str(t)[-40:]:<40} {statistics.median(ms):>12.0f} ({min(ms):.0f}-{max(ms):.0f})"
            f"{statistics.median(mb):>17.1f} ({min(mb):.1f}-{max(mb):.1f})  "
            f"{len(modules)} imported; simulator/tqdm/matplotlib: {', '.join(heavy) or 'none'}"
        )
    if len(trees) == 2:
        a, b = trees
        up = statistics.median(times[b]) / statistics.median(times[a])
        mem = statistics.median(rss[b]) / statistics.median(rss[a])
        print(f"ratio {b.name}/{a.name}: start-up {up:.2f}, RSS {mem:.2f}")


if __name__ == "__main__":
    main()
