"""A live deployment for benchmarks: an emulated plain and an emulated EAGLE-3 server (`specroute
emulate`, the Kimi profile with EAGLE-3's decode `eagle_speedup` times faster) behind `specroute
serve` from a given source tree, given the same speeds in wall time, each a process of its own.

    async with deployment(tree, time_scale=0.05, serve_args=["--policy", "cost_model"]) as url:
        ...
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from controller.cli import spawn
from policies.profile import resolve_profile

ROOT = Path(__file__).resolve().parent.parent


def profiles(folder: Path, scale: float, eagle_speedup: float) -> tuple[Path, Path]:
    """(the emulators' profile, the proxy's: the same speeds in wall time at `scale`)."""
    doc = resolve_profile("kimi-k25-int4-8gpu").model_dump(mode="json", exclude_none=True)
    for point in doc["modes"]["eagle"]["points"]:
        point["decode_tok_s"] *= eagle_speedup
    wall: dict[str, Any] = json.loads(json.dumps(doc))
    for mode in wall["modes"].values():
        for point in mode["points"]:
            point["decode_tok_s"] /= scale
            point["ttft_s"] = point.get("ttft_s", 0.0) * scale
        if "prefill_tok_s" in mode:
            mode["prefill_tok_s"] /= scale
    emulated, proxied = folder / "emulated.json", folder / "wall.json"
    emulated.write_text(json.dumps(doc))
    proxied.write_text(json.dumps(wall))
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
