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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from controller.bench.result import BenchResult, LevelResult
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
        runners = [BenchRunner(c) for c in configs]
        runners[0].keep_busy, runners[1].keep_busy = _measuring(runners[1]), _measuring(runners[0])
        done = await asyncio.gather(*(r.run() for r in runners))
        for k, result in enumerate(done):
            result.metadata["together_with"] = configs[1 - k].url
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


def _measuring(runner: BenchRunner) -> Callable[[], bool]:
    """Whether `runner`'s level still has measured requests to finish."""
    return lambda: runner.measuring


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


__all__ = ["BenchConfig", "LevelResult", "other", "run_together", "together_profile", "with_suffix"]
