"""What one ext_proc stream costs the picker's gRPC server itself: grpc.aio (the picker's, on
uvloop as `specroute picker` runs it) against grpcio's synchronous server (a thread pool),
side by side in one run.

Each server runs as its own process and answers Envoy's `ExternalProcessor.Process` as the
picker does in deploy/gateway/envoy.yaml's mode, without any routing: one request-body message
in (the body and the attributes Envoy sends), one answer out (the picker's routing answer: the
destination header, a cleared route cache and the endpoint-picker metadata, built with
controller.picker.extproc), then the stream stays open until the client half-closes it -- Envoy
closes it when the HTTP request is over, `--hold-ms` later (a 64-chunk answer 10 ms apart: about
650 ms). A grpc.aio client in this process drives `--concurrency` streams at a time, closed
loop, in rounds that alternate the servers' order.

Printed per server: the server process's CPU milliseconds per stream (utime+stime from /proc,
every thread), mean and 95% CI over rounds; the time from the body sent to the answer read,
p50/p99 (policies.stats.percentile); then sync / aio per round. The synchronous server holds
one pool thread per open stream: `--workers` below `--concurrency` queues streams (the answer
waits for a thread).

    python benchmarks/grpc_stream_cost.py [--concurrency 64] [--streams 1000] [--rounds 4]
        [--hold-ms 650] [--workers 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import proxy_overhead as po
from gateway_cost import ci_text, closed_loop

from controller.cli import spawn
from policies.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("aio", "sync")


# --- the server (a child process) ---------------------------------------------------------


def _answer() -> Any:
    """The picker's routing answer to a request body (controller.picker.exchange's shape)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from controller.picker import extproc

    endpoints = ["127.0.0.1:30001", "127.0.0.1:30002"]
    common = extproc.routed_common(endpoints)
    metadata = extproc.route_metadata(endpoints, {"ticket": "bench-1", "pool": "baseline", "reason": "bench"})
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)


def run_server(mode: str, workers: int) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    answer = _answer()

    if mode == "sync":

        class SyncProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
            def Process(self, request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:
                for req in request_iterator:
                    if req.WhichOneof("request") == "request_body":
                        yield answer

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        ep_grpc.add_ExternalProcessorServicer_to_server(SyncProcessor(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        print(f"{spawn.MARKER}grpc://127.0.0.1:{port}", flush=True)
        server.wait_for_termination()
        return

    class AioProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(self, request_iterator: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for req in request_iterator:
                if req.WhichOneof("request") == "request_body":
                    yield answer

    async def main() -> None:
        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(AioProcessor(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"{spawn.MARKER}grpc://127.0.0.1:{port}", flush=True)
        await server.wait_for_termination()

    from controller.cli.args import run_async

    run_async(main())


# --- the client and the measurement -------------------------------------------------------


@dataclass
class Result:
    cpu_ms: list[float] = field(default_factory=list)
    """Per round: the server's CPU ms per stream."""
    answer_ms: list[float] = field(default_factory=list)
    errors: int = 0


def _request() -> Any:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from google.protobuf import struct_pb2

    attrs = struct_pb2.Struct()
    attrs.update({"request.path": "/v1/chat/completions"})
    req = ep.ProcessingRequest(
        request_body=ep.HttpBody(body=json.dumps(po.BODY).encode(), end_of_stream=True)
    )
    req.attributes["envoy.filters.http.ext_proc"].CopyFrom(attrs)
    return req


async def drive(port: int, concurrency: int, n: int, hold_s: float) -> tuple[list[float], int]:
    """`n` streams, `concurrency` at a time: the answer's latency (ms) of each, and the errors."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    req = _request()
    out: list[float] = []
    errors = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)

        async def one() -> None:
            nonlocal errors
            call = stub.Process()
            t0 = time.perf_counter()
            await call.write(req)
            answer = await call.read()
            out.append((time.perf_counter() - t0) * 1000)
            if answer is grpc.aio.EOF or answer.WhichOneof("response") != "request_body":
                errors += 1
            await asyncio.sleep(hold_s)  # the HTTP request goes on; Envoy closes the stream at its end
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                errors += 1

        await closed_loop(one, n, concurrency)
    return out, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["bench", "server"], default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=SERVERS, default="aio", help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=64, help="Streams open at a time.")
    ap.add_argument("--streams", type=int, default=1000, help="Streams per server and round.")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--hold-ms", type=float, default=650.0, help="How long a stream stays open after its answer."
    )
    ap.add_argument("--workers", type=int, default=128, help="The synchronous server's thread pool.")
    args = ap.parse_args()
    if args.role == "server":
        run_server(args.mode, args.workers)
        return 0
    if args.concurrency < 1 or args.streams < 1 or args.rounds < 1 or args.workers < 1 or args.hold_ms < 0:
        ap.error(
            "--concurrency, --streams, --rounds and --workers must be at least 1, --hold-ms not negative"
        )

    me = [sys.executable, str(Path(__file__).resolve())]
    procs: dict[str, subprocess.Popen[Any]] = {}
    ports: dict[str, int] = {}
    try:
        for mode in SERVERS:
            proc, line = spawn.start_sync(
                [*me, "--role", "server", "--mode", mode, "--workers", str(args.workers)],
                cwd=str(ROOT),
                stderr=None,
            )
            procs[mode] = proc
            ports[mode] = int(spawn.url_of(line).rsplit(":", 1)[1])
        results = {mode: Result() for mode in SERVERS}
        hold_s = args.hold_ms / 1000
        for rnd in range(args.rounds):
            order = list(SERVERS) if rnd % 2 == 0 else list(reversed(SERVERS))
            for mode in order:
                pid = procs[mode].pid
                asyncio.run(
                    drive(ports[mode], args.concurrency, max(args.concurrency, args.streams // 10), hold_s)
                )
                before = po.cpu_seconds(pid)
                ms, errors = asyncio.run(drive(ports[mode], args.concurrency, args.streams, hold_s))
                after = po.cpu_seconds(pid)
                r = results[mode]
                r.cpu_ms.append((after - before) * 1000 / args.streams)
                r.answer_ms.extend(ms)
                r.errors += errors
                print(
                    f"  round {rnd + 1}/{args.rounds} {mode:<5} {r.cpu_ms[-1]:.3f} ms/stream", file=sys.stderr
                )
        print(
            f"\n{args.streams} streams per server and round, {args.concurrency} at a time, each open "
            f"{args.hold_ms:g} ms after its answer; sync: {args.workers} threads; rounds={args.rounds}; "
            "CPU: mean ± 95% CI over rounds"
        )
        row = "{:<6} {:>7} {:>22} {:>13} {:>13}"
        print(row.format("server", "n", "CPU ms/stream", "answer p50", "answer p99"))
        for mode in SERVERS:
            r = results[mode]
            line = row.format(
                mode,
                len(r.answer_ms),
                ci_text(r.cpu_ms),
                f"{percentile(r.answer_ms, 50):.3f}",
                f"{percentile(r.answer_ms, 99):.3f}",
            )
            print(line + (f"  errors={r.errors}" if r.errors else ""))
        ratios = [s / a for s, a in zip(results["sync"].cpu_ms, results["aio"].cpu_ms, strict=True) if a > 0]
        print(f"sync / aio CPU per stream: {ci_text(ratios)} (per-round ratios, n={len(ratios)})")
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
