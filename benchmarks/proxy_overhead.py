"""Proxy overhead: direct vs a minimal aiohttp pass-through vs specroute, side by side.

Runs, each as its own process: a fake backend streaming 64 SSE chunks per request as fast as it
can (two ports, one per pool), a minimal pass-through (uvloop, one shared ClientSession, no
routing), and `specroute serve` (threshold policy over both pools). A closed-loop load
generator in this process drives each target at every concurrency level, in rounds that
alternate the order of the targets. Printed per target and level: TTFT p50/p99 (ms), requests/s,
and the proxy process's CPU milliseconds per request (utime+stime from /proc/PID/stat), with
sample sizes and the spread over rounds; then the specroute/minimal CPU ratio.

    python benchmarks/proxy_overhead.py [--concurrency 1 64 256] [--requests 2000] [--rounds 3]
        [--config extra.yaml]   # e.g. decision_log + shadow_policies, to measure their cost
        [--compare-config b.yaml]  # a second specroute ("specroute-b") with these settings instead
        [--compare-root DIR]    # a second specroute ("specroute-b") run from another checkout,
                                # e.g. `git worktree add /tmp/old main`: old and new code side by side
        [--fingerprint-only]    # only the prompt fingerprint's cost (below)
        [--features-only]       # only the content features' cost (below)

First, in this process: what content features cost per request (`policies.features`, issue 24:
a 4 KB and a 100k-token chat prompt, and the acceptance model's prediction); then what prefix
tracking costs per request on a long prompt -- the canonical text of a 100k-token chat prompt,
its 512-token block fingerprint (`controller.proxy.prefixes`), and the load view with the matched
prefix of every backend -- timed on the event loop, and the fingerprint through the worker thread
specroute uses past `THREAD_FROM_CHARS`.

Note: on a small machine the load generator, the backend and the proxy share the cores, so
requests/s and TTFT are those of the whole setup; the CPU per request is the proxy's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from controller.cli import spawn
from policies.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
CHUNKS = 64
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello"}],
    "stream": True,
    "max_tokens": CHUNKS,
}


# --- child processes ----------------------------------------------------------------------


def _event(i: int) -> bytes:
    payload = {
        "id": "bench",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"reasoning_content": None, "content": f"tok{i} "},
                "logprobs": None,
                "finish_reason": None,
                "matched_stop": None,
            }
        ],
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def run_backend(ports: int, pace_s: float = 0.0) -> None:
    """The fake backend: `CHUNKS` events per request, each written on its own, `pace_s` apart
    (0: as fast as it can; a real server's decode step is 5-30 ms, so each event is its own read
    and write in every proxy)."""
    events = [_event(i) for i in range(CHUNKS)]
    tail = (
        b'data: {"id":"bench","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[],'
        b'"usage":{"prompt_tokens":2,"total_tokens":66,"completion_tokens":64}}\n\ndata: [DONE]\n\n'
    )

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for ev in events:
            await resp.write(ev)
            if pace_s:
                await asyncio.sleep(pace_s)
        await resp.write(tail)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for _ in range(ports):
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
        urls = [f"http://127.0.0.1:{a[1]}" for a in runner.addresses]
        print("listening on " + " ".join(urls), flush=True)
        await asyncio.Event().wait()

    _uvloop_run(main())


def run_passthrough(upstream: str) -> None:
    """The reference: the least an aiohttp proxy can do."""

    async def main() -> None:
        session: aiohttp.ClientSession | None = None

        async def chat(request: web.Request) -> web.StreamResponse:
            assert session is not None
            body = await request.read()
            async with session.post(
                upstream + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
            ) as up:
                resp = web.StreamResponse(
                    status=up.status, headers={"Content-Type": up.headers["Content-Type"]}
                )
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        await spawn.listen(app)
        await asyncio.Event().wait()

    _uvloop_run(main())


def _uvloop_run(coro: object) -> None:
    import uvloop

    uvloop.install()
    asyncio.run(coro)  # type: ignore[arg-type]


# --- measurement --------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Level:
    ttft_ms: list[float] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    errors: int = 0


async def drive(
    session: aiohttp.ClientSession, url: str, concurrency: int, n: int
) -> tuple[list[float], float, int]:
    """Closed loop: `concurrency` workers issue `n` requests in total. Returns TTFTs, wall time, errors."""
    ttfts: list[float] = []
    errors = 0
    remaining = n
    data = json.dumps(BODY).encode()
    headers = {"Content-Type": "application/json"}

    async def worker() -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", data=data, headers=headers) as r:
                first = True
                size = 0
                async for chunk in r.content.iter_any():
                    if first:
                        ttfts.append((time.perf_counter() - t0) * 1000)
                        first = False
                    size += len(chunk)
                if r.status != 200 or size < 64 * 100:
                    errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfts, time.perf_counter() - t0, errors


def spread(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"


async def bench(args: argparse.Namespace, targets: dict[str, tuple[str, int | None]]) -> None:
    results: dict[tuple[str, int], Level] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for c in args.concurrency:
            n = args.requests if c > 1 else max(200, args.requests // 2)
            for rnd in range(args.rounds):
                order = list(targets) if rnd % 2 == 0 else list(reversed(targets))
                for name in order:
                    url, pid = targets[name]
                    await drive(session, url, c, max(c, n // 10))  # warm-up: connections, caches
                    cpu0 = cpu_seconds(pid) if pid else 0.0
                    ttfts, wall, errors = await drive(session, url, c, n)
                    cpu1 = cpu_seconds(pid) if pid else 0.0
                    lv = results.setdefault((name, c), Level())
                    lv.ttft_ms.extend(ttfts)
                    lv.rps.append(n / wall)
                    if pid:
                        lv.cpu_ms.append((cpu1 - cpu0) * 1000 / n)
                    lv.errors += errors
                    print(
                        f"  c={c:<4} round {rnd + 1}/{args.rounds} {name:<10} {n / wall:8.0f} req/s",
                        file=sys.stderr,
                    )

    print(f"\n{CHUNKS} chunks per request; rounds={args.rounds}; spread = mean ± sd over rounds")
    head = ["conc", "target", "n", "TTFT p50 ms", "TTFT p99 ms", "req/s", "proxy CPU ms/req"]
    row = "{:>4} {:<11} {:>6} {:>12} {:>12} {:>18} {:>20}"
    print(row.format(*head))
    for c in args.concurrency:
        for name in targets:
            lv = results[(name, c)]
            cpu = spread(lv.cpu_ms) if lv.cpu_ms else "-"
            p50, p99 = f"{percentile(lv.ttft_ms, 50):.2f}", f"{percentile(lv.ttft_ms, 99):.2f}"
            line = row.format(c, name, len(lv.ttft_ms), p50, p99, spread(lv.rps), cpu)
            print(line + (f"  errors={lv.errors}" if lv.errors else ""))
        m = results[("minimal", c)].cpu_ms
        for name in (t for t in targets if t.startswith("specroute")):
            s = results[(name, c)].cpu_ms
            ratios = [a / b for a, b in zip(s, m, strict=True) if b > 0]
            print(
                f"{c:>4} {name}/minimal CPU per request: {spread(ratios)} (per-round ratios, n={len(ratios)})"
            )
        if "specroute-b" in targets:
            a, b = results[("specroute", c)].cpu_ms, results[("specroute-b", c)].cpu_ms
            ratios = [x / y for x, y in zip(a, b, strict=True) if y > 0]
            print(f"{c:>4} specroute/specroute-b CPU per request: {spread(ratios)} (n={len(ratios)})")


def fingerprint_cost(reps: int) -> None:
    """Print the per-request cost of prefix tracking on a 100k-token chat prompt."""
    from controller.proxy.config import parse_backend
    from controller.proxy.load import LoadTracker
    from controller.proxy.prefixes import (
        BLOCK_TOKENS,
        prompt_blocks,
        prompt_text,
        reported_cached_tokens,
        reported_prompt_tokens,
    )
    from policies.prefix import fingerprint

    words = "def handler(request): return render(template, context) # agentic coding context\n"
    history = (words * (400_000 // len(words) + 1))[:400_000]  # ~100k tokens at 4 chars/token
    body = {
        "messages": [
            {"role": "system", "content": history[:40_000]},
            {"role": "user", "content": history[40_000:200_000]},
            {"role": "assistant", "content": history[200_000:240_000]},
            {"role": "user", "content": history[240_000:]},
        ]
    }
    baseline = [parse_backend(f"b{i}=http://127.0.0.1:{i + 1}", "baseline") for i in range(4)]
    tracker = LoadTracker(baseline, [parse_backend("e0=http://127.0.0.1:9", "eagle")])
    tracker.track_prefixes({b.name: 1_000_000 for b in tracker})
    blocks = fingerprint(prompt_text(body, "chat"))
    tracker.release(tracker.reserve("b0", 0, blocks))

    def timed(fn: object) -> list[float]:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            out.append((time.perf_counter() - t0) * 1000)
        return out

    text = prompt_text(body, "chat")
    raw = json.dumps(body).encode()
    rows = [
        ("json.loads of the body (scale)", timed(lambda: json.loads(raw))),
        ("canonical text", timed(lambda: prompt_text(body, "chat"))),
        ("fingerprint (on the loop)", timed(lambda: fingerprint(text))),
        ("view, 5 backends matched", timed(lambda: tracker.view(0.0, blocks))),
    ]

    async def threaded() -> list[float]:
        import controller.proxy.prefixes as prefixes

        prefixes.THREAD_FROM_CHARS = 1  # force the worker-thread path
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            await prompt_blocks(body, "chat")
            out.append((time.perf_counter() - t0) * 1000)
        return out

    rows.append(("text + fingerprint in a thread", asyncio.run(threaded())))
    # what every request pays, short prompts included: its blocks (none under 2,048 characters)
    # and reading the cache report out of the answer's last events
    short = {"messages": [{"role": "user", "content": "hello " * 50}]}
    tail = (
        b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":80,'
        b'"total_tokens":144,"completion_tokens":64,"prompt_tokens_details":{"cached_tokens":64}}}\n\n'
        b"data: [DONE]\n\n"
    )
    # (no whole 2,048-character block: prompt_blocks stops after the text)
    rows.append(("short prompt: canonical text", timed(lambda: prompt_text(short, "chat"))))
    rows.append(
        (
            "cache report from the last events",
            timed(lambda: (reported_cached_tokens(tail), reported_prompt_tokens(tail))),
        )
    )
    print(
        f"prefix tracking on a {len(text):,}-character chat prompt ({len(blocks)} blocks of {BLOCK_TOKENS} "
        f"tokens), n={reps} each:"
    )
    for name, ms in rows:
        print(f"  {name:<34} {spread(ms)} ms (p50 {percentile(ms, 50):.3f}, p99 {percentile(ms, 99):.3f})")
    print()


def features_cost(reps: int) -> None:
    """Print the per-request cost of content features (`policies.features.extract_features`, run
    where the proxy builds `RequestInfo`) on a 4 KB chat prompt and on a 100k-token one, and of the
    acceptance model's prediction for them (in the policy's `choose`). Targets (issue 24): median
    <= 30 us at 4 KB, <= 1 ms at 100k tokens."""
    from policies.acceptance import AcceptanceModel
    from policies.features import extract_features

    code = "def handler(request): return render(template, context) # agentic coding context\n"
    system = "You are a coding assistant. Answer with code first, then a short explanation.\n" * 8
    question = (code * 60)[: 4096 - len(system)]
    small = {"model": "m", "temperature": 0.2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]}  # fmt: skip
    history = (code * (400_000 // len(code) + 1))[:400_000]
    large = {"model": "m", "messages": [
        {"role": "system", "content": history[:40_000]},
        {"role": "user", "content": history[40_000:200_000]},
        {"role": "assistant", "content": history[200_000:240_000]},
        {"role": "user", "content": history[240_000:]},
    ]}  # fmt: skip
    model = AcceptanceModel()
    for i in range(300):  # a model that has learned something (the predict path is the full one)
        model.learn(extract_features({"prompt": f"{code} {i}"}, "completions"), None, 0.1, 0.0)

    def timed_us(fn: object) -> list[float]:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    messages: list[dict[str, str]] = small["messages"]  # type: ignore[assignment]
    chars = sum(len(m["content"]) for m in messages)
    feats = extract_features(small, "chat")
    rows = [
        (f"features, {chars:,}-char chat", timed_us(lambda: extract_features(small, "chat"))),
        (f"features, {len(history):,}-char chat", timed_us(lambda: extract_features(large, "chat"))),
        ("acceptance prediction", timed_us(lambda: model.predict(feats, None, 0.0))),
    ]
    print(f"content features (issue 24), n={reps} each:")
    for name, us in rows:
        med, p99 = statistics.median(us), percentile(us, 99)
        print(f"  {name:<34} median {med:.1f} us, p99 {p99:.1f} us ({spread(us)} us)")
    print()


def _spawn(args: list[str], root: str | None = None) -> tuple[subprocess.Popen[str], str]:
    """A child started by the shared spawn helper; the URL(s) of its listening line. With `root`,
    it runs from that checkout (its code first on the path)."""
    env = None if root is None else {**os.environ, "PYTHONPATH": str(Path(root).resolve())}
    try:
        proc, line = spawn.start_sync(args, cwd=root or str(ROOT), stderr=None, env=env)
    except spawn.StartError as e:
        raise SystemExit(f"child {args} did not start: {e}") from None
    return proc, spawn.url_of(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--requests", type=int, default=2000, help="Requests per target, level and round.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--config",
        help="Extra settings for specroute (a YAML file), e.g. decision_log and shadow_policies, to measure "
        "their cost; the backends and policy stay as set here.",
    )
    ap.add_argument(
        "--compare-config",
        help="Settings (YAML) of a second specroute, 'specroute-b', measured in the same rounds, e.g. "
        "prefix_tracking: false to isolate what prefix tracking costs.",
    )
    ap.add_argument(
        "--compare-root",
        help="A checkout whose specroute runs as 'specroute-b' (same settings), e.g. the main branch: "
        "CPU per request of two versions in the same rounds.",
    )
    ap.add_argument("--fingerprint-only", action="store_true", help="Only the fingerprint's cost.")
    ap.add_argument("--features-only", action="store_true", help="Only the content features' cost.")
    ap.add_argument("--role", choices=["backend", "passthrough"], help=argparse.SUPPRESS)
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    ap.add_argument("--ports", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--pace-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "backend":
        run_backend(args.ports, args.pace_ms / 1000)
        return 0
    if args.role == "passthrough":
        run_passthrough(args.upstream)
        return 0
    features_cost(2000)
    if args.features_only:
        return 0
    fingerprint_cost(200)
    if args.fingerprint_only:
        return 0

    me = [sys.executable, str(Path(__file__).resolve())]
    procs: list[subprocess.Popen[str]] = []
    try:
        backend, urls = _spawn([*me, "--role", "backend"])
        procs.append(backend)
        base, eagle = urls.split()
        minimal, minimal_url = _spawn([*me, "--role", "passthrough", "--upstream", base])
        procs.append(minimal)
        serve = ["serve", "--port", "0", "--baseline", base, "--eagle", eagle, "--log-level", "WARNING"]
        policy = ["--policy", "threshold", "--policy-param", "threshold=32"]
        extra = ["--config", args.config] if args.config else []
        sr, line = _spawn([sys.executable, "-m", "controller.cli", *serve, *policy, *extra])
        procs.append(sr)
        sr_url = line
        targets: dict[str, tuple[str, int | None]] = {
            "direct": (base, None),
            "minimal": (minimal_url, minimal.pid),
            "specroute": (sr_url, sr.pid),
        }
        if args.compare_config or args.compare_root:
            more = ["--config", args.compare_config] if args.compare_config else extra
            srb, line = _spawn(
                [sys.executable, "-m", "controller.cli", *serve, *policy, *more], root=args.compare_root
            )
            procs.append(srb)
            targets["specroute-b"] = (line, srb.pid)
        import uvloop

        uvloop.install()
        asyncio.run(bench(args, targets))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
