"""How long `specroute serve` takes to exit on SIGTERM when clients have stopped reading.

The promise (deploy/: systemd's TimeoutStopSec=45 against the default 5 s grace + 30 s drain):
serve keeps serving for `--shutdown-grace-s` (0 here unless --grace), drains for
`--drain-timeout-s`, then cuts what is left and exits -- in about grace + drain, not with the
drain twice (aiohttp's own shutdown used to wait the drain once more for the cancelled handlers).
The test suite checks the behaviour (exit 0, upstream requests aborted:
tests/proxy/test_proxy_shutdown.py); the time is measured here, on a machine not shared with
a test run.

Per start: a backend in this process streams SSE chunks without end, `specroute serve` in front
of it (started by `controller.cli.spawn`), N raw clients with tiny receive buffers that send a
request and never read, so the proxy's writes block; one second later SIGTERM, and the wall
time to the exit is taken. Printed: the exit times (median, min, max, n) and their ratio to the
drain timeout.

    python benchmarks/shutdown_time.py [--grace 0] [--drain 3] [--clients 3] [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.cli import spawn

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'


async def endless(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        while True:
            await resp.write(CHUNK * 64)
            await asyncio.sleep(0)
    except ConnectionError:  # serve aborts its upstream requests when it exits: the expected end
        return resp


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def one_run(backend: str, drain: float, clients: int, grace: float = 0.0) -> float:
    proc, line = await spawn.start(
        [sys.executable, "-m", "controller.cli", "serve", "--port", "0", "--baseline", backend,
         "--policy", "fixed", "--drain-timeout-s", str(drain), "--shutdown-grace-s", str(grace),
         "--log-level", "ERROR"],
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    port = int(spawn.url_of(line).rsplit(":", 1)[1])
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    body = json.dumps(chat).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    loop = asyncio.get_running_loop()
    stuck = []
    try:
        for _ in range(clients):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, request)
            stuck.append(sock)
        await asyncio.sleep(1.0)  # the socket buffers fill up; the proxy's writes block
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 120)
        took = time.perf_counter() - t0
        if code != 0:
            raise SystemExit(f"serve exited with {code}")
        return took
    finally:
        for sock in stuck:
            sock.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def main_async(args: argparse.Namespace) -> list[float]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", endless)
    app.router.add_get("/health", ok)
    app.router.add_get("/ready", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    backend = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        return [await one_run(backend, args.drain, args.clients, args.grace) for _ in range(args.runs)]
    finally:
        await runner.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drain", type=float, default=3.0, help="--drain-timeout-s of serve (default 3)")
    ap.add_argument(
        "--grace", type=float, default=0.0, help="--shutdown-grace-s of serve, before the drain (default 0)"
    )
    ap.add_argument("--clients", type=int, default=3, help="clients that stop reading (default 3)")
    ap.add_argument("--runs", type=int, default=5, help="serve starts (default 5)")
    args = ap.parse_args()
    times = asyncio.run(main_async(args))
    med = statistics.median(times)
    both = args.grace + args.drain
    print(
        f"SIGTERM to exit with {args.clients} stuck clients, grace {args.grace:g} s + drain "
        f"{args.drain:g} s, n={len(times)}:"
    )
    print(f"  median {med:.2f} s (min {min(times):.2f}, max {max(times):.2f})")
    print(f"  median / (grace + drain) = {med / both:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
