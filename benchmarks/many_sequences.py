"""Issue 37, finding 2: do requests that run many sequences (`n`, a list of prompts) slow the
other clients down past what specroute admits?

Each arm runs on fresh processes (`emulated_pair.deployment`: an emulated plain server of the
Kimi profile, cap 256, and an emulated EAGLE-3 server, cap 48; serve's bounds are the caps plus
25%: 320 and 60 sequences) with `specroute serve --policy cost_model`. Victims: `--clients`
clients in closed loop, each streaming chat requests of `--tokens` tokens. After `--warmup-s`
seconds the attacker starts, for `--window-s` seconds, `--attackers` requests at a time in
closed loop, each of `--attack-tokens` tokens per sequence:

  none      the victims alone (default settings)
  n300      chat requests with `n: 300` (serve with max_n and max_prompts_per_request 300)
  prompts300  /v1/completions requests with a list of 300 prompts (the same settings)
  maxn      chat requests at the largest `n` the default settings allow (16), `--maxn-attackers`
            at a time: many requests each within the settings

Printed per arm, over `--rounds` rounds: the victims' mean end-to-end seconds in the window
(n, 95% CI) and its ratio to `none`'s (95% CI of the difference, Welch), the victims' statuses,
and the attacker's (200: served, 400: refused, 429: queued past `admission_wait_s`). Issue 37's
target: the victims' mean within 1.5x of `none`'s with `n: 300` / 300 prompts, the attacker
refused or queued. `--against DIR` runs DIR's serve as well, side by side.

Wall-clock figures: final runs need a quiet machine.

    python benchmarks/many_sequences.py [--rounds 3] [--time-scale 0.05] [--against DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulated_pair import arguments, collect, deployment, headline
from slow_reader import ratio, show

from policies.stats import estimate

ARMS = ("none", "n300", "prompts300", "maxn")
RAISED = ["--max-n", "300", "--max-prompts-per-request", "300"]


@dataclass
class Arm:
    victims: list[float] = field(default_factory=list)
    """End-to-end seconds of the victims' requests answered 200 in the window."""
    victim_status: Counter[str] = field(default_factory=Counter)
    attack_status: Counter[str] = field(default_factory=Counter)

    def add(self, other: Arm) -> None:
        self.victims += other.victims
        self.victim_status += other.victim_status
        self.attack_status += other.attack_status


def attack_request(arm: str, tokens: int, i: int) -> tuple[str, dict[str, Any]]:
    """(path, body) of one of the attacker's requests."""
    if arm == "prompts300":
        return "/v1/completions", {
            "model": "m", "prompt": [f"Prompt {i}.{j}:" for j in range(300)], "max_tokens": tokens,
            "ignore_eos": True,
        }  # fmt: skip
    n = 300 if arm == "n300" else 16
    messages = [{"role": "user", "content": f"Say something, {i}."}]
    return "/v1/chat/completions", {
        "model": "m", "messages": messages, "n": n, "max_tokens": tokens, "ignore_eos": True,
    }  # fmt: skip


async def victim(url: str, tokens: int, seed: int, window: tuple[float, float], out: Arm) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        while time.monotonic() < window[1]:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": f"Question {rng.randrange(10**6)}?"}],
                "max_tokens": tokens, "stream": True, "ignore_eos": True,
            }  # fmt: skip
            t0 = time.monotonic()
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                async for _ in r.content.iter_any():
                    pass
                status = r.status
            if window[0] <= t0 < window[1]:
                out.victim_status[str(status)] += 1
                if status == 200:
                    out.victims.append(time.monotonic() - t0)
            await asyncio.sleep(0.05)


async def attacker(url: str, arm: str, tokens: int, seed: int, until: float, out: Arm) -> None:
    i = seed
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        while time.monotonic() < until:
            path, body = attack_request(arm, tokens, i)
            i += 1000
            async with s.post(url + path, json=body) as r:
                await r.read()
                out.attack_status[str(r.status)] += 1
            if r.status == 400:  # refused: the settings say no, asking again changes nothing
                await asyncio.sleep(0.5)


async def run_arm(arm: str, tree: Path, args: argparse.Namespace, seed: int) -> Arm:
    out = Arm()
    serve = [
        "--policy",
        "cost_model",
        "--seed",
        str(seed),
        *(RAISED if arm in ("n300", "prompts300") else []),
    ]
    async with deployment(tree, time_scale=args.time_scale, serve_args=serve) as url:
        start = time.monotonic() + args.warmup_s
        window = (start, start + args.window_s)
        victims = [
            asyncio.create_task(victim(url, args.tokens, seed * 100 + c, window, out))
            for c in range(args.clients)
        ]
        await asyncio.sleep(args.warmup_s)
        if arm != "none":
            count = args.maxn_attackers if arm == "maxn" else args.attackers
            await asyncio.gather(
                *(attacker(url, arm, args.attack_tokens, k, window[1], out) for k in range(count))
            )
        await asyncio.gather(*victims)
    return out


def main() -> int:
    ap = arguments(__doc__ or "", ARMS, clients=4, tokens=128, warmup_s=5.0)
    ap.add_argument("--attack-tokens", type=int, default=128)
    ap.add_argument("--attackers", type=int, default=2)
    ap.add_argument("--maxn-attackers", type=int, default=32)
    ap.add_argument("--window-s", type=float, default=20.0)
    args = ap.parse_args()
    print(
        f"{headline(args)}; attacker: {args.attackers} at a time ({args.maxn_attackers} for maxn), "
        f"{args.attack_tokens} tokens per sequence"
    )
    for label, arms in collect(args, "none", run_arm, Arm).items():
        print(f"\n{label}")
        print(f"{'arm':11} {'victims mean e2e s':26} {'x none':18} {'victims':18} attacker")
        ref = estimate(arms["none"].victims)
        for arm, got in arms.items():
            e2e = estimate(got.victims)
            statuses = [
                " ".join(f"{k}: {v}" for k, v in sorted(c.items()))
                for c in (got.victim_status, got.attack_status)
            ]
            print(f"{arm:11} {show(e2e, 3):26} {ratio(e2e, ref):18} {statuses[0]:18} {statuses[1] or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
