"""`specroute picker` and signals: as with serve, a supervisor may send SIGHUP (reload) or SIGUSR1
(reopen the decision log, after a rotation) as soon as it reads the listening line, and neither
may end the picker."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

import aiohttp
from helpers import start_module, wait_until
from prometheus_client.parser import text_string_to_metric_families


async def _reloads_ok(metrics_url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(metrics_url + "/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        if family.name == "specroute_config_reloads":
            return sum(
                x.value
                for x in family.samples
                if x.labels.get("result") == "ok" and x.name.endswith("_total")
            )
    return 0.0


async def test_sighup_and_sigusr1_right_after_the_listening_line_do_not_end_the_picker(
    emulator: Any, tmp_path: Path
) -> None:
    base, eagle = await emulator("baseline"), await emulator("eagle")
    config = tmp_path / "specroute.yaml"
    config.write_text(f"baseline: [{base.url}]\neagle: [{eagle.url}]\npolicy: fixed\n")
    log = tmp_path / "decisions.jsonl"
    proc, line = await start_module(
        "controller.cli", "picker", "--config", str(config), "--port", "0", "--metrics-port", "0",
        "--decision-log", str(log), "--log-level", "WARNING", stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        metrics_url = line.split("metrics on ", 1)[1].strip()
        proc.send_signal(signal.SIGHUP)
        proc.send_signal(signal.SIGUSR1)

        async def reloaded() -> bool:
            return await _reloads_ok(metrics_url) >= 1

        assert await wait_until(reloaded, 30.0, 0.1)
        assert await _reloads_ok(metrics_url) == 1 and proc.returncode is None
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
