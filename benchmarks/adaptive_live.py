"""An EAGLE-3 server that adapts its draft depth in-engine, behind serve: what serve predicts for a
request against what it measures, alone and at batch >= 64.

Live, all subprocesses: `specroute emulate --mode eagle --speculative-adaptive` (SGLang's default
ladder; `--max-running-requests 128` so that batches past 64 are reached: SGLang would cap a
speculative server at 48), `specroute serve --eagle URL` with `cost_model` (`calibrate=false`: the
ladder model's prediction, not what calibration learns from outcomes), the profile in wall time
(the built-in one with its speeds divided by `--time-scale`: the emulators run it that much
faster) and a decision log. serve learns the ladder from the emulator's `/server_info`. Beside
it, the same load on a plain emulator through its own serve: the floor an adaptive server comes
down to at batch >= 64 (both servers' profile speeds are the same ones there).

Per concurrency level, a closed loop through the `openai` client (non-streamed completions,
`ignore_eos`, answer lengths drawn in [--min-tokens, --max-tokens] so that completions do not come
in waves) for `--rounds` requests per client (`--alone` at concurrency 1); the requests kept arrived
after the first wave had and ended before the last request arrived (a steady load). Reported for the
requests that joined a batch in the level's band (batch 1 at concurrency 1, >= 64 above): n, mean
measured and predicted end-to-end seconds with 95% CIs (`policies.stats`), the mean of the
per-request ratio measured / predicted with its 95% CI, and the share of requests within 15% of
their prediction. Profile seconds are wall seconds / time scale.

    python benchmarks/adaptive_live.py [--levels 1 96 120] [--rounds 4] [--alone 30]
        [--time-scale 0.25] [--profile kimi-k25-int4-8gpu] [--json FILE]

Wall-clock figures: run it on a quiet machine (`--quick`: a small run that shows it works).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import openai
from sim_vs_live import Proc

from policies.profile import resolve_profile
from policies.stats import estimate
from simulator.engine.deployment import server_profile

WITHIN = 0.15
FLOOR = 64
"""SGLang's default ladder drafts nothing from this batch size on."""


def wall_profile(name: str, scale: float, folder: Path) -> Path:
    path = folder / "wall-profile.json"
    wall = server_profile(resolve_profile(name), speed={"baseline": 1 / scale, "eagle": 1 / scale})
    path.write_text(wall.to_json())
    return path


async def closed_loop(url: str, clients: int, rounds: int, lengths: tuple[int, int], seed: int) -> None:
    rng = random.Random(seed)
    plan = [[rng.randint(*lengths) for _ in range(rounds)] for _ in range(clients)]
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600
    ) as client:

        async def worker(mine: list[int]) -> None:
            for n in mine:
                r = await client.completions.create(
                    model="m", prompt="Say something.", max_tokens=n, extra_body={"ignore_eos": True}
                )
                if r.usage is None or r.usage.completion_tokens != n:
                    raise RuntimeError(f"asked {n} tokens, got {r.usage}")

        await asyncio.gather(*(worker(m) for m in plan))


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def level_rows(records: list[dict[str, Any]], pool: str, clients: int) -> dict[str, Any]:
    """The level's figures from its decision-log records: those that arrived after the first wave's
    arrivals and ended before the last arrival (the load is steady in between: no warm-up, no
    drain), in the level's band of batch sizes (the batch a request joined: the load it found plus
    itself)."""
    band = (1, 1) if clients == 1 else (FLOOR, 10**9)
    arrivals = sorted(r["ts"] for r in records)
    start = arrivals[min(clients, len(arrivals)) - 1] if clients > 1 else arrivals[0]
    end = arrivals[-1] if clients > 1 else float("inf")
    pairs = []
    for r in records:
        batch = r["load"][pool]["load"] + 1
        predicted = (r.get("predicted_e2e_s") or {}).get(pool)
        steady = clients == 1 or (start < r["ts"] and r["ts"] + r["duration_s"] <= end)
        if r["status"] == "ok" and predicted and steady and band[0] <= batch <= band[1]:
            pairs.append((r["duration_s"], predicted))
    measured = estimate([m for m, _ in pairs])
    predicted_e = estimate([p for _, p in pairs])
    ratio = estimate([m / p for m, p in pairs])
    within = sum(abs(m / p - 1) <= WITHIN for m, p in pairs) / len(pairs) if pairs else float("nan")
    return {
        "n": len(pairs),
        "measured": measured.to_json() if measured else None,
        "predicted": predicted_e.to_json() if predicted_e else None,
        "ratio": ratio.to_json() if ratio else None,
        "within_15pct": within,
    }


def run_server(kind: str, args: argparse.Namespace, folder: Path, profile: Path) -> dict[int, dict[str, Any]]:
    """One emulator of `kind` behind its own serve, every level; figures per level."""
    common = ["--profile", args.profile, "--port", "0", "--time-scale", str(args.time_scale), "--seed", "1"]
    emulate = ["emulate", *common, "--stats-interval-steps", "5"]
    if kind == "adaptive":
        emulate += ["--mode", "eagle", "--speculative-adaptive", "--max-running-requests", "128"]
    else:
        emulate += ["--mode", "baseline", "--max-running-requests", "256"]
    out: dict[int, dict[str, Any]] = {}
    pool = "eagle" if kind == "adaptive" else "baseline"
    for level in args.levels:
        log = folder / f"{kind}-{level}.jsonl"
        server = Proc(emulate, "listening on")
        try:
            proxy = Proc(
                ["serve", f"--{pool}", server.url, "--policy", "cost_model", "--policy-param",
                 "calibrate=false", "--profile", str(profile), "--port", "0", "--decision-log", str(log),
                 "--log-level", "WARNING", "--shutdown-grace-s", "0"],
                "listening on",
            )  # fmt: skip
            try:
                time.sleep(2.5)  # a scrape or two: serve reads the ladder from /server_info
                started = time.monotonic()
                rounds = args.alone if level == 1 else args.rounds
                lengths = (args.min_tokens, args.max_tokens)
                asyncio.run(closed_loop(proxy.url, level, rounds, lengths, level))
                took = time.monotonic() - started
            finally:
                proxy.stop()
        finally:
            server.stop()
        out[level] = {**level_rows(read_log(log), pool, level), "wall_s": took}
        print(f"  {kind} c={level}: {out[level]['n']} requests in the band, {took:.0f} s", file=sys.stderr)
    return out


def fmt(e: dict[str, Any] | None, scale: float = 1.0) -> str:
    if not e:
        return "-"
    half = e["ci95"]
    return f"{e['mean'] / scale:.3f} ±{(half or 0) / scale:.3f}"


def table(results: dict[str, dict[int, dict[str, Any]]], scale: float) -> str:
    head = ["server", "clients", "batch", "n", "measured e2e s", "predicted e2e s", "measured/predicted",
            "within 15%"]  # fmt: skip
    rows = []
    for kind, levels in results.items():
        for level, r in levels.items():
            rows.append(
                [kind, str(level), "1" if level == 1 else f">={FLOOR}", str(r["n"]),
                 fmt(r["measured"], scale), fmt(r["predicted"], scale), fmt(r["ratio"]),
                 f"{100 * r['within_15pct']:.0f}%"]
            )  # fmt: skip
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip() for x in [head, *rows]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="kimi-k25-int4-8gpu")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 96, 120], help="concurrency levels")
    ap.add_argument("--rounds", type=int, default=4, help="requests per client per level (default 4)")
    ap.add_argument("--alone", type=int, default=30, help="requests at concurrency 1 (default 30)")
    ap.add_argument("--time-scale", type=float, default=0.25, help="emulators' wall s per profile s")
    ap.add_argument("--min-tokens", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--quick", action="store_true", help="levels 1 96, 3 rounds, 8 alone, 24-48 tokens")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args()
    if args.quick:
        args.levels, args.rounds, args.alone, args.min_tokens, args.max_tokens = [1, 96], 3, 8, 24, 48
    if args.rounds < 3:
        ap.error("--rounds must be >= 3 (the first wave and the last are left out)")
    with tempfile.TemporaryDirectory(prefix="specroute-adaptive-") as tmp:
        folder = Path(tmp)
        profile = wall_profile(args.profile, args.time_scale, folder)
        results = {kind: run_server(kind, args, folder, profile) for kind in ("adaptive", "plain")}
    print(
        f"{args.profile}, SGLang's default ladder, cost_model calibrate=false; time scale {args.time_scale} "
        f"(seconds below are profile seconds); {args.rounds} requests per client ({args.alone} alone), "
        "answers "
        f"{args.min_tokens}-{args.max_tokens} tokens, steady load only (no first wave, no drain); "
        "mean ± 95% CI"
    )
    print(table(results, args.time_scale))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
