"""Issue 37, finding 6: what a stalled decision-log file costs `specroute serve` in memory.

The decision log is a FIFO that is opened for reading and never read: the writer thread's
`write` hangs once the pipe's 64 KiB are full, as on a hung disk or network mount. A sink
backend (`hostile_bodies.py --role sink`) answers every chat request at once; serve runs
`cost_model` on the Kimi profile (the default with a profile: content-aware); this process posts
`--requests` non-streaming chat requests with a 2 KB system prompt, `--concurrency` at a time,
and reads serve's RSS
before (idle, after a warm-up of 500 requests with the FIFO drained) and its peak (VmHWM) after.
Targets, one after the other on the same sink: this tree with the log stalled, the same with its
log on a regular file (the reference: what serving the requests costs by itself), and with
`--against DIR` DIR's serve with its log stalled.

Printed per target: requests, their statuses, RSS idle and peak (MiB), growth, records dropped
(`specroute_decision_log_dropped_records_total{reason="queue_full"}`) and, for this tree, the
queued bytes at the end against `decision_log_queue_bytes` (32 MiB by default). Issue 37's
target: the growth with a stalled file within the byte bound (beside the reference's growth).

    python benchmarks/decision_log_stall.py [--requests 40000] [--concurrency 32] [--against DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from controller.cli import spawn

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
SYSTEM = " ".join(
    f"Rule {i}: answer in the register of {w}." for i, w in enumerate(["law", "poetry", "code"] * 20)
)
BODY = {
    "model": "m",
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Summarise the rules above."},
    ],
    "max_tokens": 4,
}
"""A chat request with a system prompt of ~2 KB: its content features (word grams) are what
`cost_model` (serve's default with a profile, content-aware) reads, and what a queued record kept."""


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


async def drive(url: str, n: int, concurrency: int) -> Counter[str]:
    got: Counter[str] = Counter()
    left = iter(range(n))

    async def worker(s: aiohttp.ClientSession) -> None:
        for _ in left:
            try:
                async with s.post(url + "/v1/chat/completions", json=BODY) as r:
                    await r.read()
                    got[str(r.status)] += 1
            except aiohttp.ClientError as e:
                got[type(e).__name__] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return got


async def metric(url: str, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def run(label: str, sink: str, args: argparse.Namespace, stalled: bool, tree: Path | None) -> None:
    work = Path(tempfile.mkdtemp(prefix="specroute-logstall-"))
    path = work / "decisions.jsonl"
    reader = None
    if stalled:
        os.mkfifo(path)
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree is not None else None
    cmd = [sys.executable, "-m", "controller.cli", "serve", "--port", "0", "--baseline", sink,
           "--policy", "cost_model", "--profile", "kimi-k25-int4-8gpu", "--decision-log", str(path),
           "--health-check-interval-s", "3600", "--log-level", "ERROR"]  # fmt: skip
    proc, line = spawn.start_sync(cmd, stderr=None, cwd=str(tree or ROOT), env=env)
    url = spawn.url_of(line)
    try:
        asyncio.run(drive(url, 500, args.concurrency))
        if reader is not None:  # the warm-up's records go through; from now on nobody reads
            time.sleep(0.5)
            while True:
                try:
                    if not os.read(reader, 1 << 20):
                        break
                except BlockingIOError:
                    break
        time.sleep(0.5)
        idle = status_kib(proc.pid, "VmRSS")
        started = time.monotonic()
        got = asyncio.run(drive(url, args.requests, args.concurrency))
        seconds = time.monotonic() - started
        time.sleep(1.0)
        peak = status_kib(proc.pid, "VmHWM")
        dropped = asyncio.run(
            metric(url, "specroute_decision_log_dropped_records_total", reason="queue_full")
        )
        queued = asyncio.run(metric(url, "specroute_decision_log_queued_bytes")) if tree is None else None
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if reader is not None:
            os.close(reader)
    growth = (peak - idle) / 1024
    shown = ", ".join(f"{k}: {v}" for k, v in sorted(got.items()))
    extra = f", queued {queued / 2**20:.1f} MiB at the end" if queued is not None else ""
    print(
        f"{label:28} n={sum(got.values())} in {seconds:.0f} s ({shown}); RSS idle {idle / 1024:.0f} MiB, "
        f"peak {peak / 1024:.0f} MiB, growth {growth:.0f} MiB; dropped {dropped:.0f}{extra}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--against", help="Also run serve from this source tree with its log stalled.")
    args = ap.parse_args()
    sink_proc, line = spawn.start_sync(
        [sys.executable, str(HERE / "hostile_bodies.py"), "--role", "sink"], stderr=None, cwd=str(ROOT)
    )
    try:
        sink = spawn.url_of(line)
        print(f"{args.requests} requests, {args.concurrency} at a time, per target")
        run("this tree, log stalled", sink, args, stalled=True, tree=None)
        run("this tree, log on a file", sink, args, stalled=False, tree=None)
        if args.against:
            run(f"{args.against}, log stalled", sink, args, stalled=True, tree=Path(args.against).resolve())
    finally:
        sink_proc.terminate()
        sink_proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
