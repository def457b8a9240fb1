"""How long one backend scrape stalls the event loop: the whole-body parse it replaced against
the chunked, filtered read (`controller.proxy.scrape`), side by side, per /metrics body size.

A fake backend (in another process, so its own work does not count) serves a vLLM-shaped
/metrics answer: the real families' names with many label sets and histogram buckets, padded to
each size. In this process a ticker coroutine wakes every millisecond and records how late it
woke (the loop stall) while scrapes run back to back. Printed per size and method: scrapes,
ticks (stall samples), mean/p99 (nearest rank)/max stall in ms, and CPU milliseconds per scrape.
"whole" is the earlier method: read the body, parse all of it with prometheus_client's parser
on the loop.

    python benchmarks/scrape_stall.py [--sizes 55e3 1e6 8e6] [--scrapes 20]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import subprocess
import sys
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from controller.proxy.limits import read_bounded
from controller.proxy.scrape import BackendScraper

SERVER = r"""
import sys
from aiohttp import web
size = int(float(sys.argv[1]))
head = ''.join(
    f'# HELP vllm:{n} x\n# TYPE vllm:{n} gauge\nvllm:{n}{{engine="0",model_name="m"}} {v}\n'
    for n, v in (("num_requests_running", 12.0), ("num_requests_waiting", 3.0), ("kv_cache_usage_perc", 0.2))
)
lines = []
i = 0
while sum(map(len, lines)) < size:
    lines.append(
        f'vllm:request_latency_seconds_bucket{{engine="{i % 8}",le="{i * 0.01:.2f}",model_name="m"}} {i}.0\n'
    )
    i += 1
body = ('# TYPE vllm:request_latency_seconds histogram\n' + ''.join(lines) + head).encode()
async def metrics(request):
    return web.Response(body=body, content_type='text/plain')
app = web.Application()
app.router.add_get('/metrics', metrics)
web.run_app(app, host='127.0.0.1', port=int(sys.argv[2]), print=lambda *a: print('ready', flush=True))
"""


async def whole(session: aiohttp.ClientSession, url: str) -> None:
    async with session.get(url + "/metrics") as resp:
        text = (await read_bounded(resp, 64 * 1024 * 1024)).decode()
    for family in text_string_to_metric_families(text):
        for _ in family.samples:
            pass


async def measure(url: str, method: str, scrapes: int) -> tuple[list[float], float]:
    stalls: list[float] = []
    stop = False

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop:
            t = loop.time()
            await asyncio.sleep(0.001)
            stalls.append(max(0.0, loop.time() - t - 0.001))

    scraper = BackendScraper(url, timeout_s=60)
    async with aiohttp.ClientSession() as session:
        tick = asyncio.create_task(ticker())
        cpu = time.process_time()
        for _ in range(scrapes):
            if method == "whole":
                await whole(session, url)
            else:
                await scraper.scrape(session, 0.0)
        cpu = time.process_time() - cpu
        stop = True
        await tick
    return stalls, cpu / scrapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[55e3, 1e6, 8e6])
    parser.add_argument("--scrapes", type=int, default=20)
    parser.add_argument("--port", type=int, default=18950)
    args = parser.parse_args()
    print(f"{'body':>9} {'method':>9} {'scrapes':>8} {'ticks':>6} {'mean ms':>8} {'p99 ms':>8} "
          f"{'max ms':>8} {'cpu ms/scrape':>14}")  # fmt: skip
    for size in args.sizes:
        # Just under the scraper's 8 MiB limit at the top size, so the filtered read takes it all.
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(min(size, 8.3e6)), str(args.port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None and "ready" in server.stdout.readline()
            url = f"http://127.0.0.1:{args.port}"
            for method in ("whole", "filtered", "whole", "filtered"):  # alternated, twice
                stalls, cpu = asyncio.run(measure(url, method, args.scrapes))
                q = sorted(stalls)[math.ceil(0.99 * len(stalls)) - 1]  # nearest rank
                print(
                    f"{size:>9.0f} {method:>9} {args.scrapes:>8} {len(stalls):>6} "
                    f"{1e3 * statistics.mean(stalls):>8.2f} {1e3 * q:>8.2f} {1e3 * max(stalls):>8.2f} "
                    f"{1e3 * cpu:>14.1f}"
                )
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
