"""Load: the proxy under many concurrent streams and many vanishing clients, end to end.

Two emulated SGLang servers (`specroute emulate`, fast time scale, a running cap far above the
load so they are not the bottleneck) and `specroute serve` run as subprocesses, so the client
load generator in the test process does not share an event loop with them. Bounded to about a
minute each on a 2-core machine; marked `load` (run in CI by default; `-m "not load"` skips).
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from helpers import emulator_running, metric_samples, raise_open_files_limit, start_module, wait_until

from controller.cli import spawn

pytestmark = pytest.mark.load

MAX_TOKENS = 24
LONG_TOKENS = 20_000  # what vanishing clients ask for: minutes of generation unless aborted
CHAT = [{"role": "user", "content": "Count to ten, slowly and with feeling."}]
BODY = {
    "model": "m",
    "messages": CHAT,
    "stream": True,
    "max_tokens": MAX_TOKENS,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
}


@dataclass
class Stack:
    proxy_url: str
    proxy_pid: int
    emulators: list[str]
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)

    def proxy_rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proxy_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS line")

    async def in_flight(self) -> list[float]:
        return list((await metric_samples(self.proxy_url, "specroute_in_flight_requests")).values())

    async def emulator_busy(self) -> int:
        return sum([await emulator_running(url) for url in self.emulators])

    async def settle(self, timeout_s: float = 20.0) -> tuple[list[float], int]:
        """Poll until the proxy has nothing in flight and the emulators run nothing."""
        in_flight: list[float] = []
        busy = 0

        async def idle() -> bool:
            nonlocal in_flight, busy
            in_flight, busy = await self.in_flight(), await self.emulator_busy()
            return all(v == 0 for v in in_flight) and busy == 0

        await wait_until(idle, timeout_s, interval_s=0.1)
        return in_flight, busy


async def _spawn(args: list[str], stderr_path: Path, marker: str) -> tuple[asyncio.subprocess.Process, str]:
    with stderr_path.open("wb") as err:  # a file, not a pipe: an unread pipe could stall the server
        try:
            proc, line = await start_module("controller.cli", *args, marker=marker, stderr=err, timeout_s=60)
        except spawn.StartError as e:
            raise AssertionError(f"{args[0]} did not start: {e}\n{_read(stderr_path)}") from None
    return proc, spawn.url_of(line, marker)


def _read(path: Path) -> str:
    return path.read_text(errors="replace")


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Stack]]]:
    procs: list[asyncio.subprocess.Process] = []

    async def make(time_scale: float = 0.05) -> Stack:
        urls = []
        for mode in ("baseline", "eagle"):
            proc, url = await _spawn(
                ["emulate", "--mode", mode, "--port", "0", "--time-scale", str(time_scale),
                 "--max-running-requests", "4000"],
                tmp_path / f"{mode}.log",
                "listening on",
            )  # fmt: skip
            procs.append(proc)
            urls.append(url)
        # no shutdown grace: the SIGTERM at teardown need not wait 5 s with /ready at 503 first
        proc, url = await _spawn(
            ["serve", "--port", "0", "--baseline", urls[0], "--eagle", urls[1], "--log-level", "WARNING",
             "--shutdown-grace-s", "0"],
            tmp_path / "serve.log",
            "specroute listening on",
        )  # fmt: skip
        procs.append(proc)
        return Stack(url, proc.pid, urls, procs)

    yield make
    for proc in reversed(procs):
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@dataclass
class Result:
    ok: bool
    completion_tokens: int | None
    error: str | None = None


async def _stream(session: aiohttp.ClientSession, url: str, vanish_after: int | None = None) -> Result:
    """One streaming chat completion, read to the end (or abandoned after `vanish_after` events)."""
    try:
        body = BODY if vanish_after is None else {**BODY, "max_tokens": LONG_TOKENS}
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return Result(False, None, f"HTTP {r.status}: {(await r.read())[:200]!r}")
            if vanish_after is not None:
                for _ in range(vanish_after):
                    await r.content.readuntil(b"\n\n")
                r.close()  # the client vanishes mid-stream
                return Result(True, None)
            raw = await r.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        return Result(False, None, f"{type(e).__name__}: {e}")
    events = [event.removeprefix(b"data: ") for event in raw.split(b"\n\n") if event]
    if not events or events[-1] != b"[DONE]":
        return Result(False, None, f"no [DONE] at the end: {raw[-200:]!r}")
    usage = None
    for event in events[:-1]:
        obj = json.loads(event)
        if "error" in obj:
            return Result(False, None, f"error event: {obj['error']}")
        if obj.get("usage"):
            usage = obj["usage"]["completion_tokens"]
    return Result(usage == MAX_TOKENS, usage, None if usage == MAX_TOKENS else f"usage {usage}")


async def _peak_in_flight(st: Stack, stop: asyncio.Event, peaks: list[float]) -> None:
    while not stop.is_set():
        try:
            peaks.append(sum(await st.in_flight()))
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.25)


async def test_1000_concurrent_streams_complete_and_memory_returns(stack):
    n = 1000
    raise_open_files_limit(2 * n + 500)
    st = await stack(time_scale=0.05)
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        warm = await asyncio.gather(*(_stream(session, st.proxy_url) for _ in range(200)))
        assert all(r.ok for r in warm), [r.error for r in warm if not r.ok][:3]
        await st.settle()
        rss = [st.proxy_rss_kib()]
        durations = []
        peaks: list[float] = []
        for _ in range(2):
            stop = asyncio.Event()
            sampler = asyncio.create_task(_peak_in_flight(st, stop, peaks))
            t0 = loop.time()
            results = await asyncio.gather(*(_stream(session, st.proxy_url) for _ in range(n)))
            durations.append(loop.time() - t0)
            stop.set()
            await sampler
            errors = [r.error for r in results if not r.ok]
            assert not errors, f"{len(errors)} of {n} failed, e.g. {errors[:3]}"
            assert all(r.completion_tokens == MAX_TOKENS for r in results)  # every response complete
            in_flight, busy = await st.settle()
            assert in_flight and all(v == 0 for v in in_flight), in_flight
            assert busy == 0
            rss.append(st.proxy_rss_kib())
    print(
        f"\n{n} concurrent streams x2: {durations[0]:.1f} s, {durations[1]:.1f} s; peak in flight "
        f"{max(peaks, default=0):.0f}; proxy RSS KiB after warm-up/round 1/round 2: {rss}"
    )
    assert max(peaks, default=0) >= n / 2  # the streams really overlapped
    # resident memory: 1,000 open streams may grow the heap once, but it does not keep growing
    assert rss[1] - rss[0] < 64 * 1024, rss
    assert rss[2] - rss[1] < 16 * 1024, rss


async def test_10000_requests_with_20_percent_vanishing_leave_nothing_running(stack):
    """10,000 streaming requests, 400 at a time; a random 20% of the clients ask for 20,000
    tokens and close their connection after 1-3 events. Afterwards the proxy has nothing in
    flight and the emulators run nothing: every upstream stream was closed, so each abandoned
    generation was aborted (unaborted, they would run for minutes). About 10 s here."""
    n, concurrency = 10_000, 400
    raise_open_files_limit(2 * concurrency + 500)
    st = await stack(time_scale=0.02)
    rng = random.Random(20)
    plan = [rng.randint(1, 3) if rng.random() < 0.2 else None for _ in range(n)]
    gate = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()

    async def one(session: aiohttp.ClientSession, vanish: int | None) -> Result:
        async with gate:
            return await _stream(session, st.proxy_url, vanish)

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:
        t0 = loop.time()
        results = await asyncio.gather(*(one(s, v) for v in plan))
        elapsed = loop.time() - t0
    errors = [r.error for r in results if not r.ok]
    vanished = sum(v is not None for v in plan)
    print(f"\n{n} requests ({vanished} vanished), concurrency {concurrency}: {elapsed:.1f} s")
    assert not errors, f"{len(errors)} of {n} failed, e.g. {errors[:3]}"
    in_flight, busy = await st.settle()
    assert in_flight and all(v == 0 for v in in_flight), in_flight
    assert busy == 0
    closed = await metric_samples(st.proxy_url, "specroute_requests_total")
    by_status: dict[str, float] = {}
    for labels, value in closed.items():
        status = dict(labels)["status"]
        by_status[status] = by_status.get(status, 0) + value
    # A vanishing client is counted client_closed, unless the whole answer had gone out before the
    # proxy saw it leave (a loaded machine's late wake-ups can put a long answer in a few events).
    assert set(by_status) == {"ok", "client_closed"} and sum(by_status.values()) == n
    assert by_status["ok"] >= n - vanished and 0 < by_status["client_closed"] <= vanished
