"""Issue 37, finding 1: does one client that reads slowly move the other clients of its prompt
family off EAGLE-3?

Each arm runs on fresh processes: an emulated plain and an emulated EAGLE-3 server (`specroute
emulate`, the Kimi profile with EAGLE-3's decode `--eagle-speedup` times faster, so the victims'
requests belong on EAGLE-3 at low load) and `specroute serve --policy cost_model` (content-aware,
the default) given the same speeds in wall time. Victims: `--clients` clients in closed loop,
each streaming chat requests with the shared system prompt "You are a helpful assistant." and a
question of its own, `--tokens` tokens each. After `--warmup-s` seconds the window starts:

  none  the victims alone
  fast  the attacker's requests too, every answer read as fast as it comes
  slow  the attacker's requests, each answer the eagle pool served (`x-specroute-pool`) read at
        32 KB/s for 25 s, then the rest at once (the probe's attack: its outcome ends "ok", most of
        its time spent waiting on the client)

The attacker: 16 concurrent streaming requests of 4,000 tokens with `top_logprobs: 20` (~4.5 MB
each) with the same system prompt, sent when the window opens. Printed per arm, over `--rounds`
rounds (the arms in a new order each round): the victims' EAGLE-3 share and mean end-to-end
seconds (n, 95% CI) in the 25 s window ("attack"), in its last 15 s ("late": the attacker's
requests have left the engines, their answers are still being read slowly, so what differs from
`none` there is what specroute learned or holds, not the attacker's own load), and in the
`--after-s` seconds after it, and the ratio of each figure to `none`'s. `fast` shows what the
attacker's load alone does; issue 37's target: `slow` within 10% of `none` (share and mean e2e).
`--against DIR` runs DIR's serve as well (e.g. `git archive main | tar -x -C DIR`), side by side.

Wall-clock figures: final runs need a quiet machine.

    python benchmarks/slow_reader.py [--rounds 3] [--time-scale 0.05] [--against DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulated_pair import arguments, collect, deployment, headline

from policies.stats import Estimate, estimate, welch_difference

SYSTEM = "You are a helpful assistant."
ATTACK_REQUESTS, ATTACK_TOKENS, READ_BPS, READ_FOR_S = 16, 4000, 32 * 1024, 25.0
WINDOW_S = 25.0
LATE_S = 10.0
"""The "late" part of the window starts this long after it opens."""
ARMS = ("none", "fast", "slow")


@dataclass
class Victim:
    at: float
    """Seconds since the window opened when the request was sent."""
    pool: str
    e2e: float


@dataclass
class Arm:
    victims: list[Victim] = field(default_factory=list)
    attack: list[str] = field(default_factory=list)
    """Per attacker request: its pool and how it ended."""

    def add(self, other: Arm) -> None:
        self.victims += other.victims
        self.attack += other.attack


def chat(text: str, tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
        **extra,
    }


async def victim(url: str, tokens: int, seed: int, opened: list[float], stop: float, out: Arm) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < stop:
            body = chat(f"Question {rng.randrange(10**6)}: what is {rng.choice(['a', 'b', 'c'])}?", tokens)
            t0 = time.monotonic()
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                pool = r.headers.get("x-specroute-pool", "?")
                async for _ in r.content.iter_any():
                    pass
                ok = r.status == 200
            if ok and opened:
                out.victims.append(Victim(t0 - opened[0], pool, time.monotonic() - t0))
            await asyncio.sleep(0.05)


async def attacker(url: str, slow: bool, i: int) -> str:
    """One of the attacker's requests over a raw connection: (pool, how it ended)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    text = f"Tell me everything about topic {i}."
    body = json.dumps(chat(text, ATTACK_TOKENS, logprobs=True, top_logprobs=20))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer attacker\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body.encode())
    try:
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        pool = "eagle" if b"x-specroute-pool: eagle" in headers else "baseline"
        started, got = time.monotonic(), 0
        slowly = slow and pool == "eagle"
        while True:
            chunk = await reader.read(8192 if slow and pool == "eagle" else 1 << 20)
            if not chunk:
                return f"{pool}:cut"
            got += len(chunk)
            if chunk.endswith(b"0\r\n\r\n"):
                return f"{pool}:{'slowly' if slowly else 'at once'}"
            if slow and pool == "eagle":
                elapsed = time.monotonic() - started
                if elapsed > READ_FOR_S:
                    slow = False  # the rest at once
                elif (ahead := got / READ_BPS - elapsed) > 0:
                    await asyncio.sleep(ahead)
    finally:
        writer.close()


async def run_arm(arm: str, tree: Path, args: argparse.Namespace, seed: int) -> Arm:
    out = Arm()
    serve = ["--policy", "cost_model", "--seed", str(seed)]
    async with deployment(
        tree, time_scale=args.time_scale, eagle_speedup=args.eagle_speedup, serve_args=serve
    ) as url:
        opened: list[float] = []
        stop = time.monotonic() + args.warmup_s + WINDOW_S + args.after_s
        clients = [
            asyncio.create_task(victim(url, args.tokens, seed * 100 + c, opened, stop, out))
            for c in range(args.clients)
        ]
        await asyncio.sleep(args.warmup_s)
        opened.append(time.monotonic())
        if arm != "none":
            attack = [attacker(url, arm == "slow", i) for i in range(ATTACK_REQUESTS)]
            out.attack = list(await asyncio.gather(*attack))
        await asyncio.gather(*clients)
    return out


def share(victims: list[Victim]) -> Estimate | None:
    return estimate([1.0 if v.pool == "eagle" else 0.0 for v in victims])


def ratio(e: Estimate | None, ref: Estimate | None) -> str:
    """`e` over `ref` with the 95% CI of the difference (Welch) scaled by `ref`."""
    if e is None or ref is None or ref.mean <= 0:
        return "-"
    d = welch_difference(ref, e)
    if math.isnan(d.half):
        return f"x{e.mean / ref.mean:.2f}"
    return f"x{e.mean / ref.mean:.2f} [{1 + d.low / ref.mean:.2f}, {1 + d.high / ref.mean:.2f}]"


def show(e: Estimate | None, digits: int) -> str:
    return "n=0" if e is None else f"{e.mean:.{digits}f} ± {e.half_width or 0:.{digits}f} (n={e.n})"


def report(label: str, arms: dict[str, Arm], after_s: float) -> None:
    print(f"\n{label}")
    print(
        f"{'arm':5} {'window':7} {'EAGLE-3 share':22} {'x none':18} {'x fast':18} {'mean e2e s':24} "
        f"{'x none':18} {'x fast':18}"
    )
    windows = {"attack": (0.0, WINDOW_S), "late": (LATE_S, WINDOW_S), "after": (WINDOW_S, WINDOW_S + after_s)}
    for name, (lo, hi) in windows.items():
        figures = {}
        for arm, got in arms.items():
            vs = [v for v in got.victims if lo <= v.at < hi]
            figures[arm] = (share(vs), estimate([v.e2e for v in vs]))
        none, fast = figures["none"], figures.get("fast", (None, None))
        for arm, (sh, e2e) in figures.items():
            print(
                f"{arm:5} {name:7} {show(sh, 2):22} {ratio(sh, none[0]):18} {ratio(sh, fast[0]):18} "
                f"{show(e2e, 3):24} {ratio(e2e, none[1]):18} {ratio(e2e, fast[1]):18}"
            )
    for arm, got in arms.items():
        if got.attack:
            counts: dict[str, int] = {}
            for a in got.attack:
                counts[a] = counts.get(a, 0) + 1
            print(f"{arm}: attacker's requests " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


def main() -> int:
    ap = arguments(__doc__ or "", ARMS, clients=2, tokens=256, warmup_s=10.0)
    ap.add_argument("--eagle-speedup", type=float, default=2.0)
    ap.add_argument("--after-s", type=float, default=20.0)
    args = ap.parse_args()
    print(f"{headline(args)}; attacker: {ATTACK_REQUESTS} x {ATTACK_TOKENS} tokens, top_logprobs 20")
    for label, arms in collect(args, "none", run_arm, Arm).items():
        report(label, arms, args.after_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
