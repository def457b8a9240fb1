"""/health latency and proxy memory while hostile request bodies are in flight.

Runs as separate processes: a sink backend (reads a request, answers a fixed completion), a
`specroute serve` in front of it, and a prober that GETs specroute's /health every 5 ms and
samples its resident memory (/proc/PID/status). For reference the same is run against a minimal
aiohttp server that refuses every body over 1 MiB with 413 (aiohttp's own limit) and does
nothing else: what it measures is the machine (the senders, the kernel, other load), not
specroute. This process sends the bodies, six at once, in rounds, per scenario:

  idle         nothing in flight (the reference)
  lists        30 MB bodies of tiny JSON arrays `[],[],...` (the issue's attack: ~0.8 GB each to
               parse before the JSON budget)
  numbers      30 MB bodies of tiny numbers `0,0,...`
  prose        30 MB bodies holding one long string each (legitimate, within the budget: parsed
               and forwarded by specroute)
  L            issue 25's row L: 40 clients posting 30 MB prose bodies at once
  L2           row L2: 50 clients posting gzip bodies that inflate to 30 MB each
  H            row H: 24 streams whose backend sends a 50 MB first event (the sink does)
  INFO         issue 37's finding 4: 4 clients GET /server_info back to back, which the sink
               answers with 40 MB of JSON (400k strings of 100 characters); the minimal server
               answers 404

For L, L2 and H it also prints whether specroute's peak RSS stayed within
`memory_budget_bytes` + 150 MiB, and how long RSS took to get back below 2x its idle RSS; for
INFO, whether /health's p99 stayed within 50 ms and RSS grew by at most 100 MB over its idle RSS
(issue 37's targets).

Six senders post bodies back to back for a few seconds per run; targets alternate run by run.
Printed per target and scenario, side by side: probes n, /health p50 / p99 / max (ms), p99 over
idle p99, the CPU seconds the target used per second of the run, the statuses the senders got,
RSS at the start and at peak (MiB); then the p99 ratio specroute / minimal per scenario (of all
rounds' probes pooled, and the median and range of the per-round ratios) and each process's
VmHWM (peak since start).

    python benchmarks/hostile_bodies.py [--rounds 3] [--seconds 5] [--mb 30] [--parallel 6]
    git archive main | tar -x -C /tmp/main-tree
    python benchmarks/hostile_bodies.py --scenarios H --rounds 6 --against /tmp/main-tree

With `--against DIR` a second specroute runs DIR's code (its PYTHONPATH) beside this tree's, in
the same rounds (targets alternate), so old and new are measured on the same machine state; the
ratio this tree / against, per round, is the figure to trust on a shared machine. With `--relay`
a second reference runs too, 'aiohttp relay': a plain aiohttp proxy in front of the same sink
(forwards, relays chunk by chunk, no limits), so under H it carries the same 50 MB events; the
issue's figure stays the ratio to the minimal server, which never carries them.

The minimal server is probed all along, so each target's runs are also read beside it: the
target's p99 in its own runs over the minimal server's p99 in the same windows, when it serves
nothing but its probe ("idle beside it"): the same machine load, read off a server that carries
none of it (under H the minimal server's own runs are a storm of tiny requests, a different load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TextIO

import aiohttp
from aiohttp import web

from controller.cli import spawn
from policies.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
COMPLETION = {
    "id": "x",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


FIRST_EVENT = (
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"'
    + b"y" * (50 << 20)
    + b'"}}]}\n\n'
)
BUDGET = 512 * 1024 * 1024
"""specroute's default memory_budget_bytes."""
PARALLEL = {"L": 40, "L2": 50, "H": 24, "INFO": 4}


def info_body() -> bytes:
    """Issue 37's 40 MB /server_info."""
    states = [{"avg_spec_accept_length": 2.5}]
    return json.dumps({"model_path": "m", "internal_states": states, "pad": ["x" * 100] * 400_000}).encode()


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# --- child processes ----------------------------------------------------------------------


def run_server(max_body_bytes: int) -> None:
    """POST /v1/chat/completions reads the body (aiohttp answers 413 past `max_body_bytes`) and
    answers a fixed completion; GET /health and /ready answer 200. Prints its URL, serves forever.
    The sink behind specroute (a large limit) and the minimal reference server (1 MiB)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if b'"stream": true' in raw and max_body_bytes > 1024 * 1024:  # row H: a huge first event
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            # 1 MiB at a time, as it drains: one write of 50 MB copied the rest of the event into
            # the transport's buffer (~30 ms of CPU) even for the streams specroute refuses after
            # a few MiB, and that cost of the stand-in backend took the CPU specroute's /health
            # needed (`--against` measures old and new specroute with the same sink)
            event = memoryview(FIRST_EVENT)
            with contextlib.suppress(ConnectionError):
                for at in range(0, len(event), 1 << 20):
                    await resp.write(event[at : at + (1 << 20)])
                await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response(COMPLETION)

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    big_info = info_body() if max_body_bytes > 1024 * 1024 else b""

    async def info(request: web.Request) -> web.Response:
        return web.Response(body=big_info, content_type="application/json")

    async def main() -> None:
        app = web.Application(client_max_size=max_body_bytes)
        app.router.add_post("/v1/chat/completions", answer)
        app.router.add_get("/ready", ok)
        app.router.add_get("/health", ok)
        if max_body_bytes > 1024 * 1024:  # the sink (the minimal server has no info route: 404)
            app.router.add_get("/server_info", info)
        await spawn.listen(app)
        await asyncio.Event().wait()

    import uvloop

    uvloop.run(main())


def run_relay(sink: str) -> None:
    """`--relay`'s reference: an aiohttp server that forwards each completion request to the
    sink and relays its answer chunk by chunk as it comes (`iter_any`), nothing else: no budget,
    no checks. Under H it carries the same 50 MB events as specroute (all 24 at once), which the
    minimal server never does. Prints its URL, serves forever."""

    async def answer(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        session: aiohttp.ClientSession = request.app["session"]
        headers = {"Content-Type": "application/json"}
        async with session.post(sink + "/v1/chat/completions", data=raw, headers=headers) as r:
            resp = web.StreamResponse(
                status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "application/json")}
            )
            await resp.prepare(request)
            async for piece in r.content.iter_any():
                await resp.write(piece)
            await resp.write_eof()
            return resp

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def main() -> None:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", answer)
        app.router.add_get("/health", ok)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            app["session"] = session
            await spawn.listen(app)
            await asyncio.Event().wait()

    import uvloop

    uvloop.run(main())


def run_probe(url: str, pid: int, out: str) -> None:
    """GET /health every 5 ms (one connection, as a load balancer would) and sample RSS; append
    `time latency_ms rss_kib` lines to `out` until killed."""

    async def main(f: TextIO) -> None:
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as s:
            print("ready", flush=True)
            while True:
                t0 = time.monotonic()
                try:
                    async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
                        await r.read()
                    latency = (time.monotonic() - t0) * 1000
                except (aiohttp.ClientError, TimeoutError):
                    latency = float("inf")
                f.write(f"{t0:.6f} {latency:.3f} {rss_kib(pid)}\n")
                await asyncio.sleep(max(0.0, 0.005 - (time.monotonic() - t0)))

    with open(out, "w", buffering=1) as f:
        asyncio.run(main(f))


# --- the bodies ---------------------------------------------------------------------------


def body(kind: str, size: int) -> bytes:
    head = b'{"model": "m", "max_tokens": 1, "messages": '
    if kind == "lists":
        n = (size - 100) // 3
        return head + b'[], "x": [' + b"[]," * n + b"[]]}"
    if kind == "numbers":
        n = (size - 100) // 2
        return head + b'[], "x": [' + b"0," * n + b"0]}"
    text = "lorem ipsum dolor sit amet, " * (size // 28)
    return head + json.dumps([{"role": "user", "content": text}]).encode() + b"}"


async def send(session: aiohttp.ClientSession, url: str, data: bytes, gz: bool = False) -> str:
    headers = {"Content-Type": "application/json"}
    if gz:
        headers["Content-Encoding"] = "gzip"
    try:
        async with session.post(url + "/v1/chat/completions", data=data, headers=headers) as r:
            await r.read()
            return str(r.status)
    except aiohttp.ClientError as e:
        return type(e).__name__


async def ask_info(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(url + "/server_info") as r:
            await r.read()
            return str(r.status)
    except aiohttp.ClientError as e:
        return type(e).__name__


async def scenario(url: str, kind: str, args: argparse.Namespace) -> tuple[float, float, Counter[str]]:
    """`args.parallel` senders, each posting bodies back to back for `args.seconds`."""
    start = time.monotonic()
    statuses: Counter[str] = Counter()
    if kind == "idle":
        await asyncio.sleep(args.seconds)
        return start, time.monotonic(), statuses
    data = BODIES.get(kind, b"")
    end = start + args.seconds

    async def sender(s: aiohttp.ClientSession) -> None:
        while time.monotonic() < end:
            got = await (ask_info(s, url) if kind == "INFO" else send(s, url, data, gz=kind == "L2"))
            statuses[got] += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:
        await asyncio.gather(*(sender(s) for _ in range(PARALLEL.get(kind, args.parallel))))
    return start, time.monotonic(), statuses


SCENARIOS = ("idle", "lists", "numbers", "prose", "L", "L2", "H", "INFO")
BODIES: dict[str, bytes] = {}


def back_below(pid: int, kib: float, within_s: float) -> float | None:
    """Seconds until the process's RSS is below `kib` (None: not within `within_s`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if rss_kib(pid) < kib:
            return time.monotonic() - t0
        time.sleep(0.25)
    return None


def window_p99(samples: list[tuple[float, ...]], start: float, end: float) -> float:
    """p99 of the latencies probed between `start` and `end` (NaN when none was)."""
    return percentile([s[1] for s in samples if start <= s[0] <= end] or [float("nan")], 99)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="Rounds; each runs every scenario on both targets.")
    ap.add_argument("--seconds", type=float, default=5.0, help="Length of one scenario run.")
    ap.add_argument("--mb", type=int, default=30, help="Body size in MiB.")
    ap.add_argument("--parallel", type=int, default=6, help="Bodies in flight at once.")
    ap.add_argument(
        "--scenarios",
        nargs="+",
        choices=SCENARIOS,
        default=list(SCENARIOS),
        help="Which to run (idle always).",
    )
    ap.add_argument("--against", help="Also run specroute from this source tree, side by side.")
    ap.add_argument(
        "--relay",
        action="store_true",
        help="Also run 'aiohttp relay' (forwards to the sink and relays its answers, nothing else): "
        "a second reference that carries the backend's bytes, where the minimal server answers alone.",
    )
    ap.add_argument("--role", choices=["sink", "probe", "refuser", "relay"], help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--pid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "sink":
        run_server(256 * 1024 * 1024)
        return 0
    if args.role == "probe":
        run_probe(args.url, args.pid, args.out)
        return 0
    if args.role == "refuser":
        run_server(1024 * 1024)
        return 0
    if args.role == "relay":
        run_relay(args.url)
        return 0
    for kind in ("lists", "numbers", "prose"):
        BODIES[kind] = body(kind, args.mb * 1024 * 1024)
    BODIES["L"] = BODIES["prose"]
    BODIES["L2"] = gzip.compress(body("prose", 30 * 1024 * 1024), 9)
    BODIES["H"] = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    measure(args)
    return 0


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds the process has used (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(args: argparse.Namespace) -> None:
    me = [sys.executable, str(Path(__file__).resolve())]
    kinds = ["idle", *(k for k in SCENARIOS if k in args.scenarios and k != "idle")]
    procs: list[subprocess.Popen[str]] = []

    def child(
        cmd: list[str], marker: str = spawn.MARKER, env: dict[str, str] | None = None, cwd: Path = ROOT
    ) -> tuple[subprocess.Popen[str], str]:
        """Started by the shared spawn helper; the text after `marker` in its readiness line."""
        proc, line = spawn.start_sync(cmd, marker=marker, stderr=None, cwd=str(cwd), env=env)
        procs.append(proc)
        return proc, spawn.url_of(line, marker)

    targets = ["aiohttp minimal", "specroute"] + (["against"] if args.against else [])
    targets += ["aiohttp relay"] if args.relay else []
    outs = {t: f"/tmp/specroute-hostile-{os.getpid()}-{i}.txt" for i, t in enumerate(targets)}
    windows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    statuses: dict[tuple[str, str], Counter[str]] = {}
    rss_before: dict[tuple[str, str], int] = {}
    recovery: dict[tuple[str, str], list[float | None]] = {}
    cpu: dict[tuple[str, str], float] = {}
    pids = {}
    try:
        _, sink = child([*me, "--role", "sink"])
        serve_cmd = [sys.executable, "-m", "controller.cli", "serve", "--port", "0", "--baseline",
                     sink, "--policy", "fixed", "--log-level", "ERROR"]  # fmt: skip
        serve, serve_url = child(serve_cmd)
        refuser, refuser_url = child([*me, "--role", "refuser"])
        urls = {"specroute": serve_url, "aiohttp minimal": refuser_url}
        pids = {"specroute": serve.pid, "aiohttp minimal": refuser.pid}
        if args.against:
            tree = Path(args.against).resolve()
            # run from the tree too: `python -m` puts the working directory before PYTHONPATH, so
            # from ROOT the "against" specroute ran this tree's code
            old, urls["against"] = child(serve_cmd, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree)
            pids["against"] = old.pid
        if args.relay:
            relay, urls["aiohttp relay"] = child([*me, "--role", "relay", "--url", sink])
            pids["aiohttp relay"] = relay.pid
        for t in targets:
            probe = [*me, "--role", "probe", "--url", urls[t], "--pid", str(pids[t]), "--out", outs[t]]
            child(probe, "ready")
        time.sleep(1.0)
        idle_rss = {t: rss_kib(pids[t]) for t in targets}
        for r in range(args.rounds):
            for kind in kinds:
                for t in targets[r % len(targets) :] + targets[: r % len(targets)]:  # rotate the order
                    key = (t, kind)
                    rss_before.setdefault(key, rss_kib(pids[t]))
                    used = cpu_s(pids[t])
                    start, end, got = asyncio.run(scenario(urls[t], kind, args))
                    cpu[key] = cpu.get(key, 0.0) + cpu_s(pids[t]) - used
                    windows.setdefault(key, []).append((start, end))
                    statuses.setdefault(key, Counter()).update(got)
                    if kind in PARALLEL:
                        recovery.setdefault(key, []).append(back_below(pids[t], 2 * idle_rss[t], 30.0))
                    time.sleep(0.5)
        hwm = {t: rss_kib(pids[t], "VmHWM") for t in targets}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    samples = {}
    for t, out in outs.items():
        samples[t] = [
            tuple(float(x) for x in row.split()) for row in Path(out).read_text().splitlines() if row
        ]
        os.unlink(out)
    report(args, kinds, targets, samples, windows, statuses, rss_before, recovery, cpu, idle_rss, hwm)


def report(
    args: argparse.Namespace,
    kinds: list[str],
    targets: list[str],
    samples: dict[str, list[tuple[float, ...]]],
    windows: dict[tuple[str, str], list[tuple[float, float]]],
    statuses: dict[tuple[str, str], Counter[str]],
    rss_before: dict[tuple[str, str], int],
    recovery: dict[tuple[str, str], list[float | None]],
    cpu: dict[tuple[str, str], float],
    idle_rss: dict[str, int],
    hwm: dict[str, int],
) -> None:
    print(
        f"\n{args.parallel} senders posting {args.mb} MiB bodies back to back, {args.seconds:g} s per run, "
        f"{args.rounds} runs per scenario and target (targets rotate); /health probed every 5 ms on one "
        f"connection. 'aiohttp minimal' refuses every body over 1 MiB and does nothing else: it shows what "
        f"the machine (senders, kernel, other load) costs."
        + (f" 'against': specroute from {args.against}." if args.against else "")
    )
    print(
        f"{'target':16} {'scenario':8} {'n':>5} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} "
        f"{'p99/idle':>8} {'cpu/s':>5} {'RSS MiB start/peak':>18}  statuses"
    )
    p99s: dict[tuple[str, str], float] = {}
    per_round: dict[tuple[str, str], list[float]] = {}
    for kind in kinds:
        for t in targets:
            key = (t, kind)
            inside = [s for s in samples[t] if any(a <= s[0] <= b for a, b in windows[key])]
            per_round[key] = [window_p99(samples[t], a, b) for a, b in windows[key]]
            lat = [s[1] for s in inside]
            peak = max((s[2] for s in inside), default=0)
            p99s[key] = percentile(lat, 99)
            shown = ", ".join(f"{k}: {v}" for k, v in sorted(statuses[key].items())) or "-"
            p50, p99, worst = statistics.median(lat), p99s[key], max(lat)
            ratio = p99 / p99s[(t, "idle")]
            seconds = sum(b - a for a, b in windows[key])
            print(
                f"{t:16} {kind:8} {len(lat):5d} {p50:7.1f} {p99:7.1f} {worst:7.1f} {ratio:8.1f} "
                f"{cpu[key] / seconds:5.2f} {rss_before[key] / 1024:8.0f} / {peak / 1024:6.0f}  {shown}"
            )

    def ratios(a: str, b: str, kind: str) -> str:
        rounds = [x / y for x, y in zip(per_round[(a, kind)], per_round[(b, kind)], strict=True)]
        return (
            f"{p99s[(a, kind)] / p99s[(b, kind)]:.2f} pooled; per round (n={len(rounds)}) median "
            f"{statistics.median(rounds):.2f}, range {min(rounds):.2f}-{max(rounds):.2f}"
        )

    def beside(t: str, kind: str) -> str:
        """p99 of `t` in its own runs of `kind` over the minimal server's p99 in the same windows
        (probed all along, it does nothing then): the same load on the machine, read off a server
        that carries none of it."""
        spans = windows[(t, kind)]
        idle = [window_p99(samples["aiohttp minimal"], a, b) for a, b in spans]
        near = [s[1] for s in samples["aiohttp minimal"] if any(a <= s[0] <= b for a, b in spans)]
        rounds = [x / y for x, y in zip(per_round[(t, kind)], idle, strict=True)]
        near_p99 = percentile(near, 99)
        return (
            f"{p99s[(t, kind)] / near_p99:.2f} pooled (minimal's p99 beside it {near_p99:.1f} ms, "
            f"n={len(near)}); per round (n={len(rounds)}) median {statistics.median(rounds):.2f}, "
            f"range {min(rounds):.2f}-{max(rounds):.2f}"
        )

    for kind in kinds:
        for t in targets[1:]:
            print(f"p99 {t} / aiohttp minimal idle beside it (same windows), {kind}: {beside(t, kind)}")
        pairs = [(t, "aiohttp minimal") for t in targets[1:]]
        pairs += [("specroute", "against")] if args.against else []
        pairs += [(t, "aiohttp relay") for t in targets[1:-1]] if args.relay else []
        for a, b in pairs:
            print(f"p99 {a} / {b}, {kind}: {ratios(a, b, kind)}")
    for kind in (k for k in PARALLEL if k in kinds):
        for t in targets[1:]:
            key = (t, kind)
            inside = [x for x in samples[t] if any(a <= x[0] <= b for a, b in windows[key])]
            peak = max((x[2] for x in inside), default=0) * 1024
            if kind == "INFO":
                growth = peak / 2**20 - idle_rss[t] / 1024
                print(
                    f"INFO: {t} /health p99 {p99s[key]:.1f} ms (target <= 50: "
                    f"{'met' if p99s[key] <= 50 else 'MISSED'}), n={len(inside)}; RSS growth over idle "
                    f"{growth:.0f} MiB (target <= 100 MB: {'met' if growth * 2**20 <= 100e6 else 'MISSED'})"
                )
                continue
            back = ", ".join("not within 30 s" if x is None else f"{x:.1f} s" for x in recovery[key])
            print(
                f"{kind}: {t} peak RSS {peak / 2**20:.0f} MiB, budget + 150 MiB = "
                f"{(BUDGET >> 20) + 150} MiB: "
                f"{'within' if peak <= BUDGET + (150 << 20) else 'OVER'}; back below 2x idle "
                f"({2 * idle_rss[t] / 1024:.0f} MiB) after {back}"
            )
    print("VmHWM (peak RSS since start): " + ", ".join(f"{t} {hwm[t] / 1024:.0f} MiB" for t in targets))


if __name__ == "__main__":
    sys.exit(main())
