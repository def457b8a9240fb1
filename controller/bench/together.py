"""`specroute bench URL --together URL2`: two servers measured at the same time.

Servers that share a machine's cores (both pools on one host, as on a CPU test box) slow each
other down: a profile of each measured alone is optimistic for the pair. Here both sweeps run
level by level in step: at every concurrency level both servers run their closed loops at once
(each its own warm-up, measured and filler requests), and the next level starts when both have
finished. The server whose measured requests are done first keeps sending fillers until the
other's are done too, so every measured request of either ran with the other server loaded at
that level (the faster one's level then has more fillers and a longer wall time).
URL gets `mode`, URL2 the other mode; the result is one `BenchResult` per server and one
two-mode profile, marked `measured_together`: its points are what `profile merge --together`
makes each mode's together points (`policies.together`).

With `--rounds N` each level is measured alone and together in turn, N together runs between
N+1 alone runs of each server (alone A, alone B, together, alone A, alone B, ..., alone A, alone
B): the speed of shared cores drifts by tens of percent within minutes, and a slowdown taken from
an alone bench and a together bench minutes apart carries that drift. Pooled, the alone runs and
the together runs cover the same minutes (for a linear drift their means are equal), and each
round's slowdown (together / the mean of the alone runs around it) shows the spread. The result is
one profile with both: each mode's points measured alone and its together points.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from controller.bench.result import BenchResult, LevelResult, RequestResult, robust, summarize
from controller.bench.runner import BenchConfig, BenchRunner, LevelCallback
from policies.base import Pool
from policies.profile import Profile, parse_profile


def other(mode: Pool) -> Pool:
    return "eagle" if mode == "baseline" else "baseline"


async def run_together(
    first: BenchConfig,
    second: BenchConfig,
    *,
    on_level: LevelCallback | None = None,
) -> tuple[BenchResult, BenchResult]:
    """Both sweeps, level by level at the same time (see the module's opening). `on_level` gets
    each finished level of the first server, then of the second."""
    results: list[BenchResult] = []
    for i, level in enumerate(first.levels):
        # the prefill measurement (if any) only before the first level, on both at once
        configs = [
            replace(c, levels=(level,), prefill_lengths=c.prefill_lengths if i == 0 else ())
            for c in (first, second)
        ]
        for k, result in enumerate(await _run_pair(configs)):
            if i == 0:
                results.append(result)
            else:
                results[k].levels += result.levels
                results[k].metadata["server_info_end"] = result.metadata.get("server_info_end")
                results[k].metadata["finished"] = result.metadata.get("finished")
            if on_level is not None:
                for lv in result.levels:
                    on_level(lv)
    for result in results:
        result.metadata["levels"] = list(first.levels)
    return results[0], results[1]


RunKind = Literal["alone", "together"]
RunCallback = Callable[[RunKind, int, int, LevelResult], None]
"""`(kind, round, server index 0|1, the run's level)` after each run of `run_rounds`."""


@dataclass
class Rounds:
    """`run_rounds`' results: per server (URL, URL2) its alone runs and its together runs pooled
    level by level, and per level each round's slowdown of each server."""

    alone: tuple[BenchResult, BenchResult]
    together: tuple[BenchResult, BenchResult]
    factors: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)
    """Concurrency -> per server, per round: the together run's decode speed (its median) over
    the mean of the alone runs before and after it."""


async def run_rounds(
    first: BenchConfig, second: BenchConfig, rounds: int, *, on_run: RunCallback | None = None
) -> Rounds:
    """Each level `rounds` times together between `rounds + 1` alone runs of each server (see the
    module's opening); every run measures the configs' `requests_per_level` after `warmup`."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    configs = (first, second)
    runs: dict[tuple[RunKind, int], list[BenchResult]] = {}
    log: list[dict[str, Any]] = []
    factors: dict[int, tuple[list[float], list[float]]] = {}
    started = time.perf_counter()

    def keep(kind: RunKind, k: int, i: int, result: BenchResult) -> None:
        runs.setdefault((kind, i), []).append(result)
        (lv,) = result.levels
        log.append({"kind": kind, "round": k, "server": configs[i].url, "concurrency": lv.concurrency,
                    "started_s": round(time.perf_counter() - started, 3)})  # fmt: skip
        if on_run is not None:
            on_run(kind, k, i, lv)

    for n, level in enumerate(first.levels):
        # the prefill measurement (if any) only in the first runs, each server's alone and together
        one = [
            replace(c, levels=(level,), prefill_lengths=c.prefill_lengths if n == 0 else ()) for c in configs
        ]
        alone_speeds: list[list[float]] = [[], []]
        together_speeds: list[list[float]] = [[], []]
        for k in range(rounds + 1):
            for i, c in enumerate(one):
                keep("alone", k, i, result := await BenchRunner(c).run())
                alone_speeds[i].append(_speed(result))
            if k == rounds:
                break
            for i, result in enumerate(await _run_pair(one)):
                keep("together", k, i, result)
                together_speeds[i].append(_speed(result))
            one = [replace(c, prefill_lengths=()) for c in one]
        factors[level] = (
            _factors(alone_speeds[0], together_speeds[0]),
            _factors(alone_speeds[1], together_speeds[1]),
        )
    out = {key: _pooled(results, rounds) for key, results in runs.items()}
    for result in out.values():
        result.metadata["runs"] = log
    return Rounds(
        alone=(out[("alone", 0)], out[("alone", 1)]),
        together=(out[("together", 0)], out[("together", 1)]),
        factors=factors,
    )


def _speed(result: BenchResult) -> float:
    """A one-level run's decode speed as a profile stores it (its median); nan without one."""
    (lv,) = result.levels
    return robust(lv.summary.decode_tok_s) if lv.summary.decode_tok_s is not None else float("nan")


def _factors(alone: list[float], together: list[float]) -> list[float]:
    """Per round: the together speed over the mean of the alone speeds around it."""
    return [t / ((a + b) / 2) for t, a, b in zip(together, alone, alone[1:], strict=False)]


def _pooled(results: list[BenchResult], rounds: int) -> BenchResult:
    """One server's runs of one kind as one result: per level every run's requests, each run's
    times moved after the previous run's (a level's wall time is the sum of its runs')."""
    by_level: dict[int, list[LevelResult]] = {}
    for result in results:
        for lv in result.levels:
            by_level.setdefault(lv.concurrency, []).append(lv)
    levels = []
    for concurrency, parts in by_level.items():
        requests: list[RequestResult] = []
        offset = 0.0
        for lv in parts:
            requests += [_shifted(r, offset) for r in lv.requests]
            offset += max((r.end_s or r.start_s for r in lv.requests), default=0.0)
        levels.append(LevelResult(concurrency, requests, summarize(concurrency, requests)))
    metadata = dict(results[0].metadata)
    metadata["server_info_end"] = results[-1].metadata.get("server_info_end")
    metadata["finished"] = results[-1].metadata.get("finished")
    metadata["levels"] = list(by_level)
    metadata["rounds"] = rounds
    metadata["pooled_runs"] = len(results)
    return BenchResult(metadata=metadata, levels=levels)


def _shifted(r: RequestResult, offset: float) -> RequestResult:
    def later(t: float | None) -> float | None:
        return None if t is None else t + offset

    return replace(
        r, start_s=r.start_s + offset, first_token_s=later(r.first_token_s),
        last_token_s=later(r.last_token_s), end_s=later(r.end_s),
    )  # fmt: skip


def describe_factors(rounds: Rounds, names: tuple[str, str]) -> list[str]:
    """A line per level: each server's slowdown (the mean over rounds) and its rounds' range."""
    lines = []
    for level, per_server in rounds.factors.items():
        parts = []
        for name, fs in zip(names, per_server, strict=True):
            good = [f for f in fs if f == f]
            if not good:
                parts.append(f"{name} not measured")
                continue
            spread = f", rounds {min(good):.2f}-{max(good):.2f}" if len(good) > 1 else ""
            parts.append(f"{name} x{statistics.mean(good):.2f} (n={len(good)}{spread})")
        lines.append(f"c={level}: decode speed together / alone: " + "; ".join(parts))
    return lines


async def _run_pair(configs: Sequence[BenchConfig]) -> list[BenchResult]:
    """Two one-level sweeps at once, each sending fillers until the other's measured requests are
    done too; each result names the other server (`together_with`)."""
    first, second = BenchRunner(configs[0]), BenchRunner(configs[1])
    first.keep_busy, second.keep_busy = lambda: second.measuring, lambda: first.measuring
    done = await asyncio.gather(first.run(), second.run())
    for k, result in enumerate(done):
        result.metadata["together_with"] = configs[1 - k].url
    return list(done)


def together_profile(first: BenchResult, second: BenchResult, mode: Pool, name: str | None = None) -> Profile:
    """One two-mode profile: `first`'s levels as `mode`, `second`'s as the other mode."""
    a, b = first.to_profile(mode), second.to_profile(other(mode))
    data: dict[str, Any] = {
        "format": "specroute.profile/v1",
        "name": name or f"{first.label} + {second.label}, measured together",
        "source": f"measured together (both servers loaded at every level): {a.source} | {b.source}",
        "measured_together": True,
        "modes": {
            **{m: p.model_dump(mode="json", exclude_none=True) for m, p in a.modes.items()},
            **{m: p.model_dump(mode="json", exclude_none=True) for m, p in b.modes.items()},
        },
    }
    engines = {(p.model_extra or {}).get("engine") for p in (a, b)}
    if len(engines) == 1 and (engine := engines.pop()) is not None:
        data["engine"] = engine
    return parse_profile(data, "<bench --together>")


def with_suffix(path: str, suffix: str) -> str:
    """`run.json` -> `run.together.json` (the second server's result beside the first's)."""
    head, dot, ext = path.rpartition(".")
    return f"{head}.{suffix}.{ext}" if dot and "/" not in ext else f"{path}.{suffix}"


__all__ = [
    "BenchConfig",
    "LevelResult",
    "Rounds",
    "describe_factors",
    "other",
    "run_rounds",
    "run_together",
    "together_profile",
    "with_suffix",
]
