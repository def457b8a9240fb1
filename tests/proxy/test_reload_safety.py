"""A reload applies a config file only whole (issue 25, row E): a SIGHUP while the file is half
written used to apply the partial file as a complete config. Now the file is read until two
reads `reload_settle_s` apart agree, then parsed and validated whole; anything else keeps the
running policy, is logged and counted in `specroute_config_reloads_total{result}`."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest
from helpers import WHOLE_BODY as BODY
from helpers import metric_samples, wait_until
from prometheus_client import CollectorRegistry

from controller.cli.reload import STABLE_ATTEMPTS, ConfigReloader, FileUnstable, ReloadMetrics, read_stable
from controller.proxy.config import Settings, load_settings

if TYPE_CHECKING:
    from conftest import ServeProcess


async def _pool(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=BODY) as r:
        await r.read()
        return r.headers["x-specroute-pool"]


async def _reloads(url: str) -> dict[str, float]:
    samples = await metric_samples(url, "specroute_config_reloads_total")
    return {dict(labels)["result"]: v for labels, v in samples.items()}


class StderrLines:
    """`serve`'s stderr read line by line as it comes (a task), so a test waits for a log line
    instead of sleeping for what it reports."""

    def __init__(self, sp: ServeProcess) -> None:
        assert sp.proc.stderr is not None
        self.lines: list[str] = []
        self._stream = sp.proc.stderr
        self._task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        while raw := await self._stream.readline():
            self.lines.append(raw.decode(errors="replace"))

    def count(self, needle: str) -> int:
        return sum(needle in line for line in self.lines)

    async def wait_for(self, needle: str, count: int = 1, timeout_s: float = 30.0) -> None:
        """Until `count` lines so far contain `needle` (AssertionError after `timeout_s`)."""
        assert await wait_until(lambda: self.count(needle) >= count, timeout_s, interval_s=0.01), (
            f"no {count} line(s) with {needle!r} in:\n{self.text()}"
        )

    async def all(self) -> str:
        """Everything, once the process has closed its stderr (it exited)."""
        await self._task
        return self.text()

    def text(self) -> str:
        return "".join(self.lines)


READ = "read; reading it again in"
"""The reload's first read of the file (`read_stable`): it is settling from here on."""
CHANGING = "is changing; waiting for it to settle"
"""A read that found the file changed since the one before (`read_stable`)."""


async def test_a_file_written_in_two_parts_around_a_sighup_is_applied_only_whole(
    fake_backend, spawn_serve, tmp_path
):
    base, eagle = await fake_backend(), await fake_backend()
    cfg = tmp_path / "specroute.yaml"
    head = f"baseline: [{base.url}]\neagle: [{eagle.url}]\nreload_settle_s: 10\npolicy: fixed\n"
    cfg.write_text(head + "policy_params: {pool: baseline}\n")
    sp = await spawn_serve("--config", str(cfg), driven=True)
    stderr = StderrLines(sp)
    assert await _pool(sp.url) == "baseline"
    # Part one alone is a complete, valid file (fixed, its default pool: baseline, with seed 7);
    # part two turns it into the one meant (pool eagle). A SIGHUP comes between the two writes.
    with open(cfg, "w") as f:  # noqa: ASYNC230 - written in two steps around a signal, on purpose
        f.write(head + "seed: 7\n")
        f.flush()
        sp.signal(signal.SIGHUP)
        await stderr.wait_for(READ)  # the reload has read part one; 10 s to settle on its clock
        f.write("policy_params: {pool: eagle}\n")
    await sp.advance_clock(10)  # the second read finds the file changed ...
    await stderr.wait_for(CHANGING)
    await sp.advance_clock(10)  # ... the third finds it as the second did: applied

    async def serves_eagle() -> bool:
        return await _pool(sp.url) == "eagle"

    assert await wait_until(serves_eagle, 30.0, interval_s=0.05)
    assert (await _reloads(sp.url))["ok"] == 1
    sp.signal(signal.SIGTERM)
    assert await sp.wait() == 0
    text = await stderr.all()
    swaps = [line for line in text.splitlines() if "routing policy is now" in line]
    assert len(swaps) == 1 and '"pool": "eagle"' in swaps[0], swaps  # part one was never applied


async def test_a_file_that_keeps_changing_or_does_not_validate_is_not_applied(
    fake_backend, spawn_serve, tmp_path
):
    base, eagle = await fake_backend(), await fake_backend()
    cfg = tmp_path / "specroute.yaml"
    head = f"baseline: [{base.url}]\neagle: [{eagle.url}]\nreload_settle_s: 10\npolicy: fixed\n"
    cfg.write_text(head + "policy_params: {pool: eagle}\n")
    sp = await spawn_serve("--config", str(cfg), driven=True)
    stderr = StderrLines(sp)
    assert await _pool(sp.url) == "eagle"

    async def counted(result: str) -> bool:
        return (await _reloads(sp.url)).get(result, 0) >= 1

    # 1. a writer that never stops: a new line before each of the reload's reads, 10 s apart on
    # its clock, for all of its 8 reads
    with open(cfg, "w") as f:  # noqa: ASYNC230 - a writer that never finishes, on purpose
        f.write(head + "policy_params: {pool: baseline}\n")
        f.flush()
        sp.signal(signal.SIGHUP)
        await stderr.wait_for(READ)
        for i in range(STABLE_ATTEMPTS):
            f.write(f"# still writing {i}\n")
            f.flush()
            await sp.advance_clock(10)
            await stderr.wait_for(CHANGING, i + 1)
        assert await wait_until(lambda: counted("unstable"), 30.0, interval_s=0.05)
    assert await _pool(sp.url) == "eagle"
    assert (await metric_samples(sp.url, "specroute_config_last_reload_successful"))[()] == 0.0

    async def settled(reads: int) -> None:
        """The reload's first read (the `reads`-th of the test) taken, the clock past its settle."""
        await stderr.wait_for(READ, reads)
        await sp.advance_clock(10)

    # 2. stable, but it does not validate whole (a bad value further down), or names no backend
    for reads, broken in enumerate(
        (head + "policy_params: {pool: baseline}\nidle_timeout_s: -1\n", "policy: fixed\n"), start=2
    ):
        before = (await _reloads(sp.url)).get("invalid", 0)
        cfg.write_text(broken)
        sp.signal(signal.SIGHUP)
        await settled(reads)

        async def rose(b: float = before) -> bool:
            return (await _reloads(sp.url)).get("invalid", 0) == b + 1

        assert await wait_until(rose, 30.0, interval_s=0.05)
        assert await _pool(sp.url) == "eagle"

    # 3. a good file again is applied, and the gauge says so
    cfg.write_text(head + "policy_params: {pool: baseline}\n")
    sp.signal(signal.SIGHUP)
    await settled(4)
    assert await wait_until(lambda: counted("ok"), 30.0, interval_s=0.05)
    assert await _pool(sp.url) == "baseline"
    assert (await metric_samples(sp.url, "specroute_config_last_reload_successful"))[()] == 1.0
    sp.signal(signal.SIGTERM)
    assert await sp.wait() == 0
    text = await stderr.all()
    assert "was still changing after 8 reads" in text
    assert "idle_timeout_s" in text and "no backend configured" in text


# --- the pieces, with a fake clock -----------------------------------------------------------------


async def test_read_stable_rereads_until_two_reads_agree(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("a: 1\n")
    writes = iter(["a: 12\n", "a: 123\n"])
    slept: list[float] = []

    async def sleep(s: float) -> None:  # the file changes during the first two settle intervals
        slept.append(s)
        nxt = next(writes, None)
        if nxt is not None:
            path.write_text(nxt)

    assert await read_stable(str(path), 0.5, sleep=sleep) == b"a: 123\n"
    assert slept == [0.5, 0.5, 0.5]
    with pytest.raises(FileUnstable):

        async def always(s: float) -> None:
            path.write_text(path.read_text() + "#\n")

        await read_stable(str(path), 0.5, attempts=3, sleep=always)


def test_sighups_during_a_reload_are_folded_into_one_more(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("baseline: [http://127.0.0.1:1]\n")
    loads: list[str] = []
    applied: list[Settings] = []
    registry = CollectorRegistry()

    async def scenario() -> None:
        settling, gate = asyncio.Event(), asyncio.Event()

        async def sleep(s: float) -> None:  # the fake clock: a settle interval ends at `gate`
            settling.set()
            await gate.wait()

        def load(text: str) -> Settings:
            loads.append(text)
            return load_settings({}, {}, path, config_text=text)

        r = ConfigReloader(
            str(path), load, applied.append, ReloadMetrics(registry), settle_s=0.1, sleep=sleep
        )
        r.request()
        await settling.wait()  # the first reload has read the file once and is settling
        for _ in range(50):
            r.request()
        gate.set()
        await r.wait()

    asyncio.run(scenario())
    assert len(loads) == 2 and len(applied) == 2  # the one running, and one for all the others
    assert registry.get_sample_value("specroute_config_reloads_total", {"result": "ok"}) == 2
