"""How closely the SGLang emulator follows its speed profile (a measurement, not a test).

Starts `specroute emulate` (plain and EAGLE-3) as subprocesses and drives each with a plain
closed-loop streaming load generator at concurrency 1, 10 and 30. Per level it prints the
per-request decode rate (tokens after the first / time from first to last token; mean and 95%
interval over the requests) next to the profile's `decode_tok_s(c)`, and the total output
throughput next to two references: the profile's steady state `c * decode_tok_s(c)`, and the
closed-loop expectation `c * n / (ttft_s(c) + (n - 1) / decode_tok_s(c))`, which also counts the
time each request spends waiting for its first token (a closed-loop client cannot avoid it).

    python benchmarks/emulator_accuracy.py [--levels 1 10 30] [--rounds 3] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import aiohttp

from controller.cli import spawn
from policies.base import Pool
from policies.profile import SpeedModel, resolve_profile

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}


def t95(df: int) -> float:
    return T95.get(df, 2.0 if df < 60 else 1.96)


@dataclass
class Level:
    mode: str
    concurrency: int
    requests: int
    decode_mean: float
    decode_ci95: float
    decode_profile: float
    total_tok_s: float
    total_closed_loop: float
    total_steady: float

    @property
    def decode_ratio(self) -> float:
        return self.decode_mean / self.decode_profile

    @property
    def total_ratio(self) -> float:
        return self.total_tok_s / self.total_closed_loop


async def one_request(session: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[int, float, float]:
    """(tokens, first-token time, last-token time) of one streaming chat request."""
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = 0.0
    tokens = 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    return tokens, first, last


async def run_level(
    url: str, concurrency: int, n_requests: int, max_tokens: int
) -> tuple[list[float], float, int]:
    rates: list[float] = []
    total_tokens = 0
    remaining = n_requests
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:

        async def worker() -> None:
            nonlocal remaining, total_tokens
            while remaining > 0:
                remaining -= 1
                tokens, first, last = await one_request(s, url, max_tokens)
                total_tokens += tokens
                if tokens > 1 and last > first:
                    rates.append((tokens - 1) / (last - first))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return rates, total_tokens / elapsed, len(rates)


async def start_emulator(
    mode: str, profile: str, time_scale: float
) -> tuple[asyncio.subprocess.Process, str]:
    try:
        proc, line = await spawn.start(
            [sys.executable, "-m", "controller.cli.emulate", "--mode", mode, "--profile", profile,
             "--port", "0", "--time-scale", str(time_scale)],
            stderr=None, timeout_s=30,
        )  # fmt: skip
    except spawn.StartError as e:
        raise SystemExit(f"emulator did not start: {e}") from None
    return proc, spawn.url_of(line)


async def measure(args: argparse.Namespace) -> list[Level]:
    profile = resolve_profile(args.profile)
    out: list[Level] = []
    for mode in args.modes:
        pool: Pool = "eagle" if mode == "eagle" else "baseline"
        speed: SpeedModel = profile.speed(pool)
        proc, url = await start_emulator(mode, args.profile, args.time_scale)
        try:
            for c in args.levels:
                n = max(args.min_requests, args.rounds * c)
                rates, total, k = await run_level(url, c, n, args.max_tokens)
                scale = 1.0 / args.time_scale
                dec = speed.decode_tok_s(c) * scale
                ttft = speed.ttft_s(c) / scale
                mean = statistics.fmean(rates)
                ci = t95(k - 1) * statistics.stdev(rates) / math.sqrt(k) if k > 1 else float("nan")
                n_tok = args.max_tokens
                level = Level(
                    mode=mode,
                    concurrency=c,
                    requests=k,
                    decode_mean=mean,
                    decode_ci95=ci,
                    decode_profile=dec,
                    total_tok_s=total,
                    total_closed_loop=c * n_tok / (ttft + (n_tok - 1) / dec),
                    total_steady=c * dec,
                )
                out.append(level)
                print_row(level, flush=True)
        finally:
            proc.terminate()
            await proc.wait()
    return out


HEADER = (
    f"{'mode':<9}{'conc':>5}{'n':>5} | {'decode tok/s (95% CI)':>22}{'profile':>9}{'ratio':>7} | "
    f"{'total tok/s':>12}{'closed-loop':>12}{'ratio':>7}{'c*decode':>10}{'ratio':>7}"
)


def print_row(lv: Level, flush: bool = False) -> None:
    print(
        f"{lv.mode:<9}{lv.concurrency:>5}{lv.requests:>5} | "
        f"{lv.decode_mean:>12.2f} ± {lv.decode_ci95:<7.2f}{lv.decode_profile:>9.2f}{lv.decode_ratio:>7.3f} | "
        f"{lv.total_tok_s:>12.1f}{lv.total_closed_loop:>12.1f}{lv.total_ratio:>7.3f}"
        f"{lv.total_steady:>10.1f}{lv.total_tok_s / lv.total_steady:>7.3f}",
        flush=flush,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="kimi-k25-int4-8gpu")
    p.add_argument("--modes", nargs="+", default=["baseline", "eagle"], choices=["baseline", "eagle"])
    p.add_argument("--levels", nargs="+", type=int, default=[1, 10, 30])
    p.add_argument("--rounds", type=int, default=3, help="requests per level = rounds x concurrency")
    p.add_argument("--min-requests", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--time-scale", type=float, default=1.0, help="emulator --time-scale (rates are rescaled)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    args = p.parse_args()
    print(
        f"profile {args.profile}, {args.max_tokens} output tokens per request, time scale {args.time_scale}"
    )
    print(HEADER, flush=True)
    levels = asyncio.run(measure(args))
    worst = max(max(abs(lv.decode_ratio - 1), abs(lv.total_ratio - 1)) for lv in levels)
    print(f"largest deviation from the profile (decode, closed-loop total): {worst:.1%}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(lv) for lv in levels], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
