"""A reload applies a config file only whole (issue 25, row E): a SIGHUP while the file is half
written used to apply the partial file as a complete config. Now the file is read until two
reads `reload_settle_s` apart agree, then parsed and validated whole; anything else keeps the
running policy, is logged and counted in `specroute_config_reloads_total{result}`."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
import pytest
from helpers import WHOLE_BODY as BODY
from helpers import metric_samples, wait_until
from prometheus_client import CollectorRegistry

from controller.cli.reload import ConfigReloader, FileUnstable, ReloadMetrics, read_stable
from controller.proxy.config import Settings, load_settings


async def _pool(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=BODY) as r:
        await r.read()
        return r.headers["x-specroute-pool"]


async def _reloads(url: str) -> dict[str, float]:
    samples = await metric_samples(url, "specroute_config_reloads_total")
    return {dict(labels)["result"]: v for labels, v in samples.items()}


async def _read_stderr(sp) -> asyncio.Future[bytes]:
    assert sp.proc.stderr is not None
    return asyncio.ensure_future(sp.proc.stderr.read())


async def test_a_file_written_in_two_parts_around_a_sighup_is_applied_only_whole(
    fake_backend, spawn_serve, tmp_path
):
    base, eagle = await fake_backend(), await fake_backend()
    cfg = tmp_path / "specroute.yaml"
    head = f"baseline: [{base.url}]\neagle: [{eagle.url}]\nreload_settle_s: 2.0\npolicy: fixed\n"
    cfg.write_text(head + "policy_params: {pool: baseline}\n")
    sp = await spawn_serve("--config", str(cfg))
    stderr = await _read_stderr(sp)
    assert await _pool(sp.url) == "baseline"
    # Part one alone is a complete, valid file (fixed, its default pool: baseline, with seed 7);
    # part two turns it into the one meant (pool eagle). A SIGHUP comes between the two writes.
    with open(cfg, "w") as f:  # noqa: ASYNC230 - written in two steps around a signal, on purpose
        f.write(head + "seed: 7\n")
        f.flush()
        sp.signal(signal.SIGHUP)
        await asyncio.sleep(0.5)  # well within reload_settle_s: the reload has read part one
        f.write("policy_params: {pool: eagle}\n")

    async def serves_eagle() -> bool:
        return await _pool(sp.url) == "eagle"

    assert await wait_until(serves_eagle, 30.0, interval_s=0.1)
    assert (await _reloads(sp.url))["ok"] == 1
    sp.signal(signal.SIGTERM)
    assert await sp.wait() == 0
    text = (await stderr).decode()
    assert "is changing; waiting for it to settle" in text
    swaps = [line for line in text.splitlines() if "routing policy is now" in line]
    assert len(swaps) == 1 and '"pool": "eagle"' in swaps[0], swaps  # part one was never applied


async def test_a_file_that_keeps_changing_or_does_not_validate_is_not_applied(
    fake_backend, spawn_serve, tmp_path
):
    base, eagle = await fake_backend(), await fake_backend()
    cfg = tmp_path / "specroute.yaml"
    head = f"baseline: [{base.url}]\neagle: [{eagle.url}]\nreload_settle_s: 0.5\npolicy: fixed\n"
    cfg.write_text(head + "policy_params: {pool: eagle}\n")
    sp = await spawn_serve("--config", str(cfg))
    stderr = await _read_stderr(sp)
    assert await _pool(sp.url) == "eagle"

    # 1. a writer that never stops (a line every 20 ms for longer than 8 reads 0.5 s apart)
    stop = asyncio.Event()

    async def writer() -> None:
        with open(cfg, "w") as f:  # noqa: ASYNC230 - a writer that never finishes, on purpose
            f.write(head + "policy_params: {pool: baseline}\n")
            i = 0
            while not stop.is_set():
                f.write(f"# still writing {i}\n")
                f.flush()
                i += 1
                await asyncio.sleep(0.02)

    task = asyncio.create_task(writer())
    await asyncio.sleep(0.1)
    sp.signal(signal.SIGHUP)

    async def counted(result: str) -> bool:
        return (await _reloads(sp.url)).get(result, 0) >= 1

    assert await wait_until(lambda: counted("unstable"), 30.0, interval_s=0.1)
    stop.set()
    await task
    assert await _pool(sp.url) == "eagle"
    assert (await metric_samples(sp.url, "specroute_config_last_reload_successful"))[()] == 0.0

    # 2. stable, but it does not validate whole (a bad value further down), or names no backend
    for broken in (head + "policy_params: {pool: baseline}\nidle_timeout_s: -1\n", "policy: fixed\n"):
        before = (await _reloads(sp.url)).get("invalid", 0)
        cfg.write_text(broken)
        sp.signal(signal.SIGHUP)

        async def rose(b: float = before) -> bool:
            return (await _reloads(sp.url)).get("invalid", 0) == b + 1

        assert await wait_until(rose, 30.0, interval_s=0.1)
        assert await _pool(sp.url) == "eagle"

    # 3. a good file again is applied, and the gauge says so
    cfg.write_text(head + "policy_params: {pool: baseline}\n")
    sp.signal(signal.SIGHUP)
    assert await wait_until(lambda: counted("ok"), 30.0, interval_s=0.1)
    assert await _pool(sp.url) == "baseline"
    assert (await metric_samples(sp.url, "specroute_config_last_reload_successful"))[()] == 1.0
    sp.signal(signal.SIGTERM)
    assert await sp.wait() == 0
    text = (await stderr).decode()
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
