"""Issue 37, finding 6: the decision-log queue was bounded by count (100,000 records of ~8.4 KB:
each kept its request's `RequestInfo`, view and decisions alive), ~824 MB with a stalled file,
outside the memory budget. Now the observer queues the compact record dict and what waits for
the disk is bounded in bytes (`decision_log_queue_bytes`, the batch stuck in `write` included);
past it records are dropped and counted, and writing resumes once the disk does."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp
from helpers import metric_samples, wait_until

from controller.proxy.decision_log import DecisionLog
from controller.proxy.decision_record import decision_record, record_bytes
from controller.proxy.shadow import ShadowChoice
from controller.proxy.ticket import RequestRecord
from policies.base import BackendLoad, Decision, LoadView, Outcome, PoolLoad, RequestInfo
from policies.features import extract_features
from policies.registry import PolicyContext, default_registry


class HungDisk:
    """`os.write` that blocks while `hung` is set, as a write to a hung disk or mount does."""

    def __init__(self) -> None:
        self.free = threading.Event()
        self.blocked = threading.Event()

    def __call__(self, fd: int, buf: memoryview) -> int:
        if not self.free.is_set():
            self.blocked.set()
            self.free.wait()
        return os.write(fd, buf)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


async def test_a_hung_disk_holds_at_most_the_byte_bound_and_counts_the_rest(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    disk = HungDisk()
    drops: list[tuple[str, int]] = []
    dlog = DecisionLog(
        path,
        max_queued_bytes=10_000,
        batch_interval_s=0.001,
        write=disk,
        on_drop=lambda r, n: drops.append((r, n)),
    )
    try:
        dlog.write({"i": 0}, 1000)
        assert await wait_until(disk.blocked.is_set)  # the writer is stuck in write() with record 0
        peak = 0
        for i in range(1, 100):
            dlog.write({"i": i}, 1000)
            peak = max(peak, dlog.queued_bytes)
        assert peak <= 10_000 and dlog.queued_bytes == 10_000  # the stuck batch counts as well
        assert dlog.dropped == 90 and {r for r, _ in drops} == {"queue_full"}
        disk.free.set()  # the disk comes back: what was queued is written, then new records are
        assert await wait_until(lambda: len(_lines(path)) == 10)
        assert await wait_until(lambda: dlog.queued_bytes == 0)
        dlog.write({"i": 100}, 1000)
        assert await wait_until(lambda: len(_lines(path)) == 11)
    finally:
        disk.free.set()
        dlog.close()
    assert [r["i"] for r in _lines(path)] == [*range(10), 100]


def _record(hint: str, shadows: int) -> RequestRecord:
    pol = default_registry(entry_points=False).create("online", {}, PolicyContext(None, 0))
    body = {"messages": [{"role": "system", "content": "You are a helpful assistant. " * 40}]}
    info = RequestInfo("chat", True, 3000, 256, hint, None, extract_features(body, "chat"))
    view = LoadView(
        PoolLoad(
            "baseline",
            tuple(BackendLoad(f"b{i}", "baseline", in_flight=3, running=4, queued=1) for i in range(4)),
        ),
        PoolLoad(
            "eagle", tuple(BackendLoad(f"e{i}", "eagle", accept_length=2.71828, running=2) for i in range(4))
        ),
    )
    d = Decision(
        "eagle", "e0", "faster_eagle", {"baseline": 0.4123, "eagle": 0.3321}, {"baseline": 2.4, "eagle": 2.1}
    )
    out = Outcome(info, d, 1.0, 0.123456, 200, 2.234567, "ok", 2.5, 1024)
    shadow = tuple(ShadowChoice(f"shadow{i}", d) for i in range(shadows))
    return RequestRecord(info, view, d, d, out, 200, pol, shadow, 0.5)


def test_the_size_estimate_covers_what_a_queued_record_holds() -> None:
    """What a queued record holds (tracemalloc, over 2,000 of them) is within `record_bytes`, with
    the longest hint (32 characters) and with shadows; and it is far less than the request's
    objects the queue used to keep (its `RequestInfo` with the prompt's grams, view, decisions)."""
    for hint, shadows in (("h" * 32, 0), ("code", 2), ("x" * 32, 5)):
        record = _record(hint, shadows)
        tracemalloc.start()
        kept = [decision_record((record, 1.7e9 + i + math.pi)) for i in range(2000)]
        held = tracemalloc.get_traced_memory()[0] / len(kept)
        tracemalloc.stop()
        assert held <= record_bytes(kept[0]), (hint, shadows, held, record_bytes(kept[0]))
        del kept


async def test_serve_with_a_stalled_decision_log_keeps_serving_within_its_byte_bound(
    spawn_serve, fake_backend, tmp_path
):
    """The decision log is a FIFO nobody reads (a file whose writes hang once the pipe's buffer
    is full): serve answers every request, holds at most `decision_log_queue_bytes` of records,
    counts the rest `queue_full`, and writes again once the file drains."""
    fb = await fake_backend(chunks=2)
    fifo = tmp_path / "decisions.jsonl"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open, never read (until the end)
    bound = 256 * 1024
    try:
        sp = await spawn_serve(
            "--baseline", fb.url, "--policy", "fixed", "--decision-log", str(fifo),
            "--decision-log-queue-bytes", str(bound), "--health-check-interval-s", "3600",
            "--log-level", "ERROR",
        )  # fmt: skip

        async def one(s: aiohttp.ClientSession) -> int:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with s.post(sp.url + "/v1/chat/completions", json=body) as r:
                await r.read()
                return r.status

        async def queued() -> float:
            return sum((await metric_samples(sp.url, "specroute_decision_log_queued_bytes")).values())

        async def dropped() -> float:
            samples = await metric_samples(sp.url, "specroute_decision_log_dropped_records_total")
            return samples.get((("reason", "queue_full"),), 0.0)

        sent = 0
        most = 0.0
        async with aiohttp.ClientSession() as s:
            while await dropped() < 50:  # the pipe's buffer (64 KiB) fills, then the queue
                statuses = await asyncio.gather(*(one(s) for _ in range(50)))
                assert statuses == [200] * 50
                sent += 50
                most = max(most, await queued())
                assert sent <= 5000
        assert most <= bound
        assert bound - 4096 <= await queued() <= bound  # full, to within a record
        data = bytearray()
        loop = asyncio.get_running_loop()
        loop.add_reader(reader, lambda: data.extend(_read_some(reader)))  # the disk drains ...

        async def drained() -> bool:
            return await queued() == 0

        assert await wait_until(drained, 30.0)
        async with aiohttp.ClientSession() as s:  # ... and a new record is written again
            assert await one(s) == 200
        assert await wait_until(lambda: len(data.splitlines()) >= 1 and data.endswith(b"\n"), 10.0)

        async def all_accounted() -> bool:
            return len(data.splitlines()) + await dropped() == sent + 1 and data.endswith(b"\n")

        assert await wait_until(all_accounted, 20.0)  # every record written or counted
        assert all(json.loads(line)["status"] == "ok" for line in data.splitlines())
        loop.remove_reader(reader)
    finally:
        os.close(reader)


def _read_some(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 20)
    except BlockingIOError:
        return b""
