"""A live deployment for benchmarks: an emulated plain and an emulated EAGLE-3 server (`specroute
emulate`, the Kimi profile with EAGLE-3's decode `eagle_speedup` times faster) behind `specroute
serve` from a given source tree, given the same speeds in wall time, each a process of its own;
and the rounds of a benchmark that compares arms on this tree and another one (`--against`),
gathered per arm (`collect`).

    async with deployment(tree, time_scale=0.05, serve_args=["--policy", "cost_model"]) as url:
        ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence, Sized
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

from controller.cli import spawn
from policies.profile import Profile, resolve_profile
from simulator.engine.deployment import server_profile

ROOT = Path(__file__).resolve().parent.parent


def profiles(folder: Path, scale: float, eagle_speedup: float) -> tuple[Path, Path]:
    """(the emulators' profile, the proxy's: the same speeds in wall time at `scale`)."""
    doc = resolve_profile("kimi-k25-int4-8gpu").model_dump(mode="json", exclude_none=True)
    for point in doc["modes"]["eagle"]["points"]:
        point["decode_tok_s"] *= eagle_speedup
    emulated, proxied = folder / "emulated.json", folder / "wall.json"
    emulated.write_text(json.dumps(doc))
    wall = server_profile(Profile.model_validate(doc), speed={"baseline": 1 / scale, "eagle": 1 / scale})
    proxied.write_text(wall.to_json())
    return emulated, proxied


@asynccontextmanager
async def deployment(
    tree: Path, *, time_scale: float, eagle_speedup: float = 1.0, serve_args: Sequence[str] = ()
) -> AsyncIterator[str]:
    """Fresh emulators (this tree's) and serve (`tree`'s) for one run; serve's URL. Everything is
    killed on the way out."""
    with tempfile.TemporaryDirectory() as tmp:
        emulated, wall = profiles(Path(tmp), time_scale, eagle_speedup)
        procs: list[asyncio.subprocess.Process] = []
        try:
            urls = []
            for mode in ("baseline", "eagle"):
                proc, line = await spawn.start(
                    [sys.executable, "-m", "controller.cli", "emulate", "--mode", mode, "--port", "0",
                     "--profile", str(emulated), "--time-scale", str(time_scale)],
                    stderr=asyncio.subprocess.DEVNULL, cwd=str(ROOT),
                )  # fmt: skip
                procs.append(proc)
                urls.append(spawn.url_of(line))
            env = {**os.environ, "PYTHONPATH": str(tree)}
            proc, line = await spawn.start(
                [sys.executable, "-m", "controller.cli", "serve", "--port", "0", "--baseline", urls[0],
                 "--eagle", urls[1], "--profile", str(wall), "--log-level", "ERROR", *serve_args],
                stderr=asyncio.subprocess.DEVNULL, cwd=str(tree), env=env,
            )  # fmt: skip
            procs.append(proc)
            yield spawn.url_of(line)
        finally:
            for proc in procs:
                proc.kill()
                await proc.wait()


def arguments(
    doc: str, arms: Sequence[str], *, clients: int, tokens: int, warmup_s: float
) -> argparse.ArgumentParser:
    """The arguments every such benchmark takes: `--rounds`, `--time-scale`, `--arms`,
    `--against`, and the victims' `--clients`, `--tokens`, `--warmup-s` (these defaults)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-scale", type=float, default=0.05, help="Wall seconds per profile second.")
    ap.add_argument("--arms", nargs="+", default=list(arms), choices=arms)
    ap.add_argument("--against", help="Also run serve from this source tree.")
    ap.add_argument("--clients", type=int, default=clients)
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--warmup-s", type=float, default=warmup_s)
    return ap


def headline(args: argparse.Namespace) -> str:
    """The first words of a benchmark's output: rounds, victims, time scale."""
    return (
        f"{args.rounds} round(s); victims: {args.clients} clients x {args.tokens} tokens; "
        f"time scale {args.time_scale}"
    )


def rounds(args: argparse.Namespace, reference: str) -> Iterator[tuple[int, str, Path, str]]:
    """(round, tree label, tree, arm) of every run: `args.rounds` rounds of every arm on this tree
    and `args.against`'s, in a new order each round (a machine that slows down over the benchmark
    then weighs on every arm alike). Exits with a usage error when `reference` is not an arm."""
    if reference not in args.arms:
        sys.exit(f"--arms needs {reference} (the reference)")
    trees = {"this tree": ROOT} | ({args.against: Path(args.against).resolve()} if args.against else {})
    for r in range(args.rounds):
        order = [(label, arm) for label in trees for arm in args.arms]
        random.Random(r).shuffle(order)
        for label, arm in order:
            yield r, label, trees[label], arm


class Gathered(Protocol):
    """What the runs of one arm gathered: the victims' requests, and `add` for another run's."""

    @property
    def victims(self) -> Sized: ...

    def add(self, other: Self) -> None: ...


G = TypeVar("G", bound=Gathered)


def collect(
    args: argparse.Namespace,
    reference: str,
    run_arm: Callable[[str, Path, argparse.Namespace, int], Coroutine[Any, Any, G]],
    empty: Callable[[], G],
) -> dict[str, dict[str, G]]:
    """Every run of `rounds` (`run_arm(arm, tree, args, round)`, a fresh event loop each), the
    runs of each arm gathered per tree label; a line per run as it ends."""
    results: dict[str, dict[str, G]] = {}
    for r, label, tree, arm in rounds(args, reference):
        got = asyncio.run(run_arm(arm, tree, args, r))
        results.setdefault(label, {a: empty() for a in args.arms})[arm].add(got)
        print(f"round {r + 1}: {label} {arm}: {len(got.victims)} victim requests", flush=True)
    return results
