"""The decision log when the disk misbehaves (issue 25, row F): it used to leave a torn JSON
line after a full disk, lose records silently and keep writing a file that had been moved
away. Now the file holds whole lines only, every record is either written or counted as
dropped, writing resumes when there is room again, and a removed or rotated file (or a SIGHUP)
makes it open its path anew. The disk-full case runs twice: through a write seam that fails as
a full disk does (a short write, then ENOSPC), and through the real `serve` on a tiny tmpfs."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
from pathlib import Path

import aiohttp
from helpers import WHOLE_BODY as BODY
from helpers import fill_file_system, metric_samples, wait_until

from controller.proxy.decision_log import DecisionLog


class FullDisk:
    """`os.write` with a capacity: `room` bytes still fit (None: no limit); a write that does not
    fit writes what fits and the next one fails with ENOSPC, as on a full file system."""

    def __init__(self) -> None:
        self.room: int | None = None

    def __call__(self, fd: int, buf: memoryview) -> int:
        if self.room is None:
            return os.write(fd, buf)
        if self.room == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, buf[: self.room])
        self.room -= n
        return n


def _lines(*paths: Path) -> list[dict]:
    """Every line of the files, parsed: a torn line fails the test here."""
    out = []
    for path in paths:
        if path.exists():
            for line in path.read_bytes().split(b"\n")[:-1]:
                out.append(json.loads(line))
            assert path.read_bytes().endswith(b"\n") or not path.read_bytes()
    return out


def _record(i: int) -> dict:
    return {"i": i, "pad": "x" * 50}


async def test_disk_full_drops_and_counts_whole_records_then_resumes(tmp_path):
    path = tmp_path / "d.jsonl"
    disk = FullDisk()
    drops: list[tuple[str, int]] = []
    dlog = DecisionLog(
        path, transform=_record, batch_interval_s=0.001, write=disk, on_drop=lambda r, n: drops.append((r, n))
    )
    try:
        for i in range(10):
            dlog.write(i)
        assert await wait_until(lambda: len(_lines(path)) == 10)
        disk.room = 150  # two lines and a half fit
        for i in range(10, 30):
            dlog.write(i)
        assert await wait_until(lambda: len(_lines(path)) + dlog.dropped == 30)
        assert dlog.dropped > 0
        disk.room = None  # space is back
        for i in range(30, 40):
            dlog.write(i)
        assert await wait_until(lambda: len(_lines(path)) + dlog.dropped == 40)
    finally:
        dlog.close()
    written = [r["i"] for r in _lines(path)]
    assert written == sorted(written) and set(range(10)) | set(range(30, 40)) <= set(written)
    assert len(written) + dlog.dropped == 40 and sum(n for _, n in drops) == dlog.dropped
    assert {r for r, _ in drops} == {"write_error"}


async def test_a_record_that_cannot_be_encoded_costs_only_itself(tmp_path):
    path = tmp_path / "d.jsonl"

    def transform(i: int) -> dict:
        if i == 3:
            raise OverflowError("int too large to convert to float")
        return {"i": i, "x": float("nan") if i == 5 else 1.0}

    drops: list[str] = []
    dlog = DecisionLog(path, transform=transform, batch_interval_s=0, on_drop=lambda r, n: drops.append(r))
    for i in range(8):
        dlog.write(i)
    dlog.close()
    assert [r["i"] for r in _lines(path)] == [0, 1, 2, 4, 6, 7] and drops == ["unencodable"] * 2


async def test_a_removed_or_rotated_file_is_noticed_and_reopened(tmp_path):
    path = tmp_path / "d.jsonl"
    dlog = DecisionLog(path, transform=_record, batch_interval_s=0.001)
    try:
        dlog.write(0)
        assert await wait_until(lambda: len(_lines(path)) == 1)
        path.unlink()  # removed
        dlog.write(1)
        assert await wait_until(lambda: path.exists() and len(_lines(path)) == 1)
        os.rename(path, tmp_path / "d.jsonl.old")  # rotated away by another tool
        dlog.write(2)
        assert await wait_until(lambda: path.exists() and len(_lines(path)) == 1)
        os.rename(path, tmp_path / "d.jsonl.older")
        dlog.reopen()  # what SIGHUP does: the new file exists even before the next record
        assert await wait_until(path.exists)
        dlog.write(3)
        assert await wait_until(lambda: len(_lines(path)) == 1)
        os.truncate(path, 0)  # logrotate's copytruncate: the next line starts the file, no hole
        dlog.write(4)
        assert await wait_until(lambda: len(_lines(path)) == 1)
    finally:
        dlog.close()
    assert [r["i"] for r in _lines(tmp_path / "d.jsonl.old")] == [1]
    assert [r["i"] for r in _lines(tmp_path / "d.jsonl.older")] == [2]
    assert [r["i"] for r in _lines(path)] == [4] and not path.read_bytes().startswith(b"\0")


# --- through serve, on a real full file system ------------------------------------------------------


async def test_serve_on_a_full_disk_keeps_serving_counts_drops_and_reopens_on_sighup(
    fake_backend, spawn_serve, tiny_tmpfs
):
    base = await fake_backend()
    log_path = tiny_tmpfs / "decisions.jsonl"
    sp = await spawn_serve("--baseline", base.url, "--policy", "fixed", "--decision-log", str(log_path))
    sent = 0

    async def burst(n: int) -> None:
        nonlocal sent
        async with aiohttp.ClientSession() as s:

            async def one() -> None:
                async with s.post(sp.url + "/v1/chat/completions", json=BODY) as r:
                    assert r.status == 200
                    await r.read()

            await asyncio.gather(*(one() for _ in range(n)))
        sent += n

    async def dropped() -> float:
        return (await metric_samples(sp.url, "specroute_decision_log_dropped_records_total"))[
            (("reason", "write_error"),)
        ]

    async def accounted() -> bool:
        return len(_lines(log_path)) + await dropped() == sent

    await burst(5)
    assert await wait_until(accounted)
    filler = tiny_tmpfs / "filler"
    await asyncio.to_thread(fill_file_system, filler, 4096)  # one page left: the next batches tear
    for _ in range(4):
        await burst(25)
    assert await wait_until(accounted, 20.0)
    assert await dropped() > 0
    filler.unlink()  # space is back
    await burst(10)
    assert await wait_until(accounted, 20.0)
    written = len(_lines(log_path))
    assert written >= 15  # the first 5, the last 10, and what fitted
    # logrotate: move the file away, SIGHUP; the next records go to a new file at the path
    os.rename(log_path, tiny_tmpfs / "decisions.jsonl.1")
    sp.signal(signal.SIGHUP)
    assert await wait_until(log_path.exists, 20.0)
    await burst(3)
    assert await wait_until(lambda: len(_lines(log_path)) == 3, 20.0)
    assert len(_lines(tiny_tmpfs / "decisions.jsonl.1")) == written
    sp.signal(signal.SIGTERM)
    assert await sp.wait() == 0


async def test_serve_reopens_its_decision_log_on_sighup_and_after_removal(
    fake_backend, spawn_serve, tmp_path
):
    """logrotate's way (move, then SIGHUP) and a plain removal, through serve (no tmpfs needed)."""
    base = await fake_backend()
    log_path = tmp_path / "decisions.jsonl"
    sp = await spawn_serve("--baseline", base.url, "--policy", "fixed", "--decision-log", str(log_path))

    async def request() -> None:
        async with aiohttp.ClientSession() as s, s.post(sp.url + "/v1/chat/completions", json=BODY) as r:
            assert r.status == 200
            await r.read()

    await request()
    assert await wait_until(lambda: len(_lines(log_path)) == 1, 20.0)
    os.rename(log_path, tmp_path / "decisions.jsonl.1")
    sp.signal(signal.SIGHUP)
    assert await wait_until(log_path.exists, 20.0)  # reopened at once, before any record
    await request()
    assert await wait_until(lambda: len(_lines(log_path)) == 1, 20.0)
    log_path.unlink()
    await request()  # noticed before this record's batch: a new file at the path
    assert await wait_until(lambda: log_path.exists() and len(_lines(log_path)) == 1, 20.0)
    assert len(_lines(tmp_path / "decisions.jsonl.1")) == 1
    sp.signal(signal.SIGTERM)
    assert await sp.wait() == 0
