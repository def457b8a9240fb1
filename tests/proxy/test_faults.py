"""One backend failing never takes the service down: faults injected into emulated SGLang servers
(killed or frozen processes, 5xx, queue full, stalls, dropped streams, both pools down) while the
real proxy runs on 127.0.0.1. After every scenario the proxy's own /metrics shows every
`specroute_in_flight_requests` sample at exactly 0.

Emulators that must die for real run as `specroute emulate` subprocesses (SIGKILL, SIGSTOP);
the others run in-process so their fault knobs can be turned while traffic runs."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import openai
import pytest
from aiohttp import web
from fakes import ShiftedClock
from helpers import CHAT, assert_in_flight_zero, emulator_running, metric_samples, start_module, wait_until

if TYPE_CHECKING:
    from conftest import RunningProxy

    from simulator.emulator.app import EmulatorServer

LONG = {"max_tokens": 4000, "extra_body": {"ignore_eos": True}}


# --- emulators -----------------------------------------------------------------------------


@dataclass
class EmulatorProcess:
    """`specroute emulate` as a subprocess that can be killed, frozen and restarted on its port."""

    args: list[str]
    proc: asyncio.subprocess.Process | None = None
    port: int = 0
    history: list[asyncio.subprocess.Process] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        proc, line = await start_module(
            "controller.cli.emulate", *self.args, "--port", str(self.port), stderr=asyncio.subprocess.DEVNULL
        )
        assert " listening on http://" in line, line
        self.port = int(line.rsplit(":", 1)[1])
        self.proc = proc
        self.history.append(proc)

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        await self.proc.wait()

    def freeze(self, frozen: bool = True) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    async def stop_all(self) -> None:
        for proc in self.history:
            if proc.returncode is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                await proc.wait()


@pytest.fixture
async def emulator_process() -> AsyncIterator[Callable[..., Awaitable[EmulatorProcess]]]:
    started: list[EmulatorProcess] = []

    async def make(mode: str, *flags: str) -> EmulatorProcess:
        ep = EmulatorProcess(["--mode", mode, "--profile", "kimi-k25-int4-8gpu", *flags])
        await ep.start()
        started.append(ep)
        return ep

    yield make
    for ep in started:
        await ep.stop_all()


@pytest.fixture
def unreachable() -> Iterator[Callable[[], str]]:
    """URLs of backends whose host never answers a TCP connect (a powered-off machine or a
    dropped route), made on loopback: a listening socket that never accepts, its one-slot accept
    queue filled, so the kernel drops further SYNs and connect() hangs until its timeout."""
    sockets: list[socket.socket] = []

    def make() -> str:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        sockets.append(listener)
        port = listener.getsockname()[1]
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            sockets.append(filler)
        probe = socket.socket()
        probe.settimeout(0.5)
        try:
            probe.connect(("127.0.0.1", port))
        except TimeoutError:
            pass
        else:
            pytest.skip("this kernel accepts connections beyond the listen backlog")
        finally:
            probe.close()
        return f"http://127.0.0.1:{port}"

    yield make
    for sock in sockets:
        sock.close()


# --- helpers -------------------------------------------------------------------------------


async def complete(c: openai.AsyncOpenAI, stream: bool, **kw: Any) -> tuple[str, str]:
    """One short request; returns (pool, text) and asserts it finished."""
    if stream:
        raw = await c.chat.completions.with_raw_response.create(
            model="m", messages=CHAT, stream=True, max_tokens=8, stream_options={"include_usage": True}, **kw
        )
        chunks = [ch async for ch in raw.parse()]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return raw.headers["x-specroute-pool"], text
    raw = await c.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=8, **kw)
    out = raw.parse()
    assert out.usage is not None and out.usage.completion_tokens >= 1
    return raw.headers["x-specroute-pool"], out.choices[0].message.content or ""


# --- scenarios -----------------------------------------------------------------------------


async def _eagle_process_first(
    emulator_process: Callable[..., Awaitable[EmulatorProcess]],
    emulator: Callable[..., Awaitable[EmulatorServer]],
    proxy: Callable[..., Awaitable[RunningProxy]],
    **settings: Any,
) -> tuple[EmulatorProcess, EmulatorServer, RunningProxy]:
    """An eagle emulator as a subprocess (killable, freezable) at full time scale, an in-process
    baseline one, and a proxy that sends everything to eagle; health checks every 0.2 s unless
    `settings` say otherwise."""
    eagle = await emulator_process("eagle", "--time-scale", "1")
    base = await emulator("baseline")
    p = await proxy(
        baseline=[base.url],
        eagle=[eagle.url],
        policy="fixed",
        policy_params={"pool": "eagle"},
        **{"health_check_interval_s": 0.2, **settings},
    )
    return eagle, base, p


async def test_backend_killed_while_traffic_runs(emulator_process, emulator, proxy):
    eagle, base, p = await _eagle_process_first(
        emulator_process, emulator, proxy, health_check_timeout_s=1.0, idle_timeout_s=10.0,
        outlier_base_ejection_s=1.0,
    )  # fmt: skip
    c = p.client()
    # streams in progress on eagle: their first chunk has arrived
    streams = [
        await c.chat.completions.create(model="m", messages=CHAT, stream=True, **LONG) for _ in range(4)
    ]
    for s in streams:
        first = await s.__anext__()
        assert first.choices[0].delta.role == "assistant"
    assert await emulator_running(eagle.url) == 4
    await eagle.kill()

    async def drain(stream: Any) -> str:
        try:
            async for _ in stream:
                pass
        except openai.APIError as e:
            return str(e)
        return "ended without an error event"

    errors = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 30)
    # "stream broke" (the peer closed), not the idle timeout's "sent nothing for ..."
    assert all("stream broke" in e for e in errors), errors

    # requests not yet started: no client-visible error, served by the other pool
    for i in range(6):
        pool, text = await complete(c, stream=i % 2 == 0)
        assert pool == "baseline" and text
    assert await wait_until(lambda: _healthy(p.url, eagle.url, False), 5)  # ejected

    await eagle.start()  # comes back on the same port
    assert await wait_until(lambda: _healthy(p.url, eagle.url, True), 10)  # readmitted
    # the broken streams ejected it (4 failures in a row) for outlier_base_ejection_s
    assert (await metric_samples(p.url, "specroute_backend_ejections_total"))[
        (("backend", eagle.url), ("pool", "eagle"))
    ] == 1.0
    assert await wait_until(lambda: _ejected(p.url, eagle.url, False), 10)
    pool, _ = await complete(c, stream=True)
    assert pool == "eagle"
    await c.close()
    await assert_in_flight_zero(p.url)
    assert await emulator_running(base.url) == 0
    assert await emulator_running(eagle.url) == 0


async def _healthy(proxy_url: str, backend: str, want: bool) -> bool:
    samples = await metric_samples(proxy_url, "specroute_backend_healthy")
    return samples[(("backend", backend), ("pool", "eagle"))] == (1.0 if want else 0.0)


async def _ejected(proxy_url: str, backend: str, want: bool) -> bool:
    samples = await metric_samples(proxy_url, "specroute_backend_ejected")
    return samples[(("backend", backend), ("pool", "eagle"))] == (1.0 if want else 0.0)


async def test_frozen_backend_times_out_and_traffic_moves(emulator_process, emulator, proxy):
    """SIGSTOP: the kernel still accepts connections, nothing answers (a hung server). The
    proxy's timeouts and health probes run on its clock (`ShiftedClock`): a minute's limits pass
    in ticks while only the frozen backend is waited on, no waiting."""
    clock = ShiftedClock()
    eagle, base, p = await _eagle_process_first(
        emulator_process, emulator, proxy, clock=clock,
        first_byte_timeout_s=60, idle_timeout_s=60, health_check_timeout_s=5, health_check_interval_s=5,
    )  # fmt: skip
    c = p.client()
    stream = await c.chat.completions.create(model="m", messages=CHAT, stream=True, **LONG)
    await stream.__anext__()
    eagle.freeze()
    try:
        with pytest.raises(openai.APIError, match=r"sent nothing for 60 s"):
            await clock.ticking(_consume(stream), 61)
        # the first byte times out on eagle: retried on baseline (no tick once it is there)
        pool, text = await clock.ticking(
            complete(c, stream=True), 61, when=lambda: p.tracker.get(base.url).in_flight == 0
        )
        assert pool == "baseline" and text
        assert await clock.ticking(wait_until(lambda: _healthy(p.url, eagle.url, False), 30), 61)
        await assert_in_flight_zero(p.url)
    finally:
        eagle.freeze(False)
    assert await clock.ticking(wait_until(lambda: _healthy(p.url, eagle.url, True), 30), 61)
    # the frozen stream's upstream connection was closed: the emulator aborts it once it runs again
    assert await wait_until(lambda: _running_is(eagle.url, 0), 10)
    pool, _ = await complete(c, stream=False)
    assert pool == "eagle"
    await c.close()
    await assert_in_flight_zero(p.url)


async def _consume(stream: Any) -> None:
    async for _ in stream:
        pass


async def _running_is(url: str, n: int) -> bool:
    return await emulator_running(url) == n


async def test_5xx_and_queue_full_are_retried_once_on_the_other_pool(emulator, proxy):
    base = await emulator("baseline")
    eagle = await emulator("eagle", max_running_requests=1)
    clock = ShiftedClock()
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="fixed", policy_params={"pool": "eagle"},
        outlier_consecutive_failures=100,  # every request meets eagle first: what this test is about
        clock=clock,
    )  # fmt: skip
    c = p.client()

    def requests_total(pool: str, status: str) -> Awaitable[float]:
        async def read() -> float:
            samples = await metric_samples(p.url, "specroute_requests_total")
            backend = base.url if pool == "baseline" else eagle.url
            return samples.get((("backend", backend), ("pool", pool), ("status", status)), 0.0)

        return read()

    # 5xx from eagle (emulated fault): retried on baseline before the first byte
    eagle.faults.error_rate = 1.0
    for stream in (True, False):
        pool, text = await complete(c, stream=stream)
        assert pool == "baseline" and text
    assert await requests_total("baseline", "ok") == 2.0
    failovers = await metric_samples(p.url, "specroute_failovers_total")
    assert failovers[(("pool", "eagle"),)] == 2.0
    eagle.faults.error_rate = 0.0

    # queue full: eagle's one slot is taken and its queue bound is 0
    eagle.faults.max_queued_requests = 0
    hog = await c.chat.completions.create(model="m", messages=CHAT, stream=True, **LONG)
    await hog.__anext__()
    for stream in (True, False):  # streaming: HTTP 200 + error event; else HTTP 503
        pool, text = await complete(c, stream=stream)
        assert pool == "baseline" and text
    assert await requests_total("baseline", "ok") == 4.0
    # The first queue-full fails over; then eagle backs off (overload_backoff_s), so the second
    # request is routed to baseline at once: no second failover, and eagle is not blamed.
    assert (await metric_samples(p.url, "specroute_failovers_total"))[(("pool", "eagle"),)] == 3.0
    await hog.close()

    # both pools failing: the second failure is answered with the backend's status, in OpenAI's
    # shape with the backend's text, counted as error
    base.faults.error_rate = eagle.faults.error_rate = 1.0
    clock.advance(p.settings.overload_backoff_s)  # eagle's back-off after the queue-full ends
    with pytest.raises(openai.InternalServerError) as info:
        await c.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
    assert info.value.status_code == 500  # the backend's status, the backend's text
    assert info.value.code == "backend_failed" and "HTTP 500" in info.value.message
    assert await requests_total("baseline", "error") == 1.0
    await c.close()
    await assert_in_flight_zero(p.url)
    assert await emulator_running(eagle.url) == 0 and await emulator_running(base.url) == 0


async def test_stalled_backends_give_504_and_release_the_slot(emulator, proxy):
    base = await emulator("baseline")
    eagle = await emulator("eagle")
    base.faults.stall_s = eagle.faults.stall_s = 60.0  # accept, then say nothing
    clock = ShiftedClock()  # the proxy's: a minute's timeouts pass in ticks, no waiting
    p = await proxy(
        baseline=[base.url],
        eagle=[eagle.url],
        policy="threshold",
        first_byte_timeout_s=60,
        request_timeout_s=60,  # the non-streaming request's own timeout (never re-run elsewhere)
        health_check_interval_s=3600,
        scrape_interval_s=3600,  # no background scrape may overlap the idle check below
        clock=clock,
    )
    c = p.client()
    for stream in (True, False):
        for b in (base.url, eagle.url):
            p.tracker.set_healthy(b, True)
        # a 504 from the first-byte timeouts; waiting out the 60 s stall would be the client's
        # own 30 s timeout (APITimeoutError) instead
        with pytest.raises(openai.APIStatusError) as info:
            await clock.ticking(complete(c, stream=stream), 61)
        assert info.value.status_code == 504
        assert info.value.response.json()["error"]["code"] == "backend_timeout"
    await c.close()
    await assert_in_flight_zero(p.url)
    timeouts = await metric_samples(p.url, "specroute_requests_total")
    assert sum(v for k, v in timeouts.items() if ("status", "timeout") in k) == 2.0

    # the upstream requests were closed: the emulators' HTTP handlers were cancelled (the one
    # active request left is the /metrics scrape itself)
    async def idle() -> bool:
        gauges = [await metric_samples(u, "sglang:http_requests_active") for u in (base.url, eagle.url)]
        return all(v == 1.0 for g in gauges for v in g.values())

    assert await wait_until(idle, 5)


async def test_stream_dropped_mid_way_ends_with_error_event(emulator, proxy):
    base = await emulator("baseline")
    base.faults.die_after_chunks = 3
    p = await proxy(baseline=[base.url], policy="fixed")
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            p.url + "/v1/chat/completions",
            json={"model": "m", "messages": CHAT, "stream": True, "max_tokens": 50, "ignore_eos": True},
        ) as r,
    ):
        body = await asyncio.wait_for(r.read(), 10)
    assert r.status == 200
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert b'"code": "stream_broken"' in events[-2] and b'"type": "server_error"' in events[-2]
    await assert_in_flight_zero(p.url)


async def test_both_backends_down(emulator_process, proxy):
    base = await emulator_process("baseline", "--time-scale", "0.05")
    eagle = await emulator_process("eagle", "--time-scale", "0.05")
    p = await proxy(
        baseline=[base.url],
        eagle=[eagle.url],
        policy="threshold",
        connect_timeout_s=1.0,
        health_check_interval_s=0.2,
        health_check_timeout_s=0.5,
    )
    c = p.client()
    await complete(c, stream=True)
    await base.kill()
    await eagle.kill()
    with pytest.raises(openai.APIStatusError) as info:
        await complete(c, stream=True)
    # the first request finds both refusing; it already gets the 503 of "no healthy backend"
    assert info.value.status_code == 503
    assert info.value.response.json()["error"]["code"] == "no_healthy_backend"

    async def both_ejected() -> bool:
        samples = await metric_samples(p.url, "specroute_backend_healthy")
        return all(v == 0.0 for v in samples.values())

    assert await wait_until(both_ejected, 5)
    for stream in (True, False):
        with pytest.raises(openai.APIStatusError) as info:
            await complete(c, stream=stream)
        assert info.value.status_code == 503
        assert info.value.response.json()["error"]["code"] == "no_healthy_backend"
    await c.close()
    async with aiohttp.ClientSession() as s:
        async with s.get(p.url + "/ready") as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "no_healthy_backend"
        async with s.get(p.url + "/health") as r:
            assert r.status == 200
    await assert_in_flight_zero(p.url)


async def test_unreachable_backend_fails_over_within_the_connect_timeout(unreachable, fake_backend, proxy):
    """A backend host that never answers the TCP handshake (not one that refuses): the request
    moves to the other pool after connect_timeout_s with no client-visible error, the backend is
    ejected, and the next requests go to the other pool at once."""
    base = await fake_backend(chunks=2)
    eagle = unreachable()
    p = await proxy(
        baseline=[base.url],
        eagle=[eagle],
        policy="fixed",
        policy_params={"pool": "eagle"},
        connect_timeout_s=0.5,
        health_check_interval_s=60,
        health_check_timeout_s=60,  # the first probe never ends: only the request can eject eagle
        outlier_consecutive_failures=1,
    )
    c = p.client()
    for stream in (True, False):
        pool, text = await complete(c, stream=stream)
        assert pool == "baseline" and text
    # the first request waited out the connect timeout once (one failover); the next skipped eagle
    assert await _ejected(p.url, eagle, True)
    assert (await metric_samples(p.url, "specroute_failovers_total"))[(("pool", "eagle"),)] == 1.0
    await c.close()
    await assert_in_flight_zero(p.url)


async def test_both_backends_unreachable_give_503(unreachable, proxy):
    base, eagle = unreachable(), unreachable()
    p = await proxy(
        baseline=[base],
        eagle=[eagle],
        policy="threshold",
        connect_timeout_s=0.5,
        health_check_interval_s=60,
        health_check_timeout_s=60,
        outlier_consecutive_failures=2,  # each request tries both: the second one ejects them
    )
    c = p.client()
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as info:
            await complete(c, stream=True)
        assert info.value.status_code == 503
        assert info.value.response.json()["error"]["code"] == "no_healthy_backend"
    await c.close()
    async with aiohttp.ClientSession() as s:
        async with s.get(p.url + "/ready") as r:
            assert r.status == 503
        async with s.get(p.url + "/health") as r:
            assert r.status == 200
    await assert_in_flight_zero(p.url)


@pytest.mark.parametrize("fault", ["stall", "die"])
async def test_stream_broken_mid_event_still_ends_with_a_parseable_error_event(fault, proxy):
    """The backend's last bytes end in the middle of an SSE event (a process killed mid-write, or
    a stall between two TCP segments). The error event specroute appends must still be a whole,
    parseable event: the client has to see the OpenAI-shaped error, not a JSON decode error."""
    chunk = {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "a"}}],
    }
    event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    stalling = asyncio.Event()

    async def half_event(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event)
        await asyncio.sleep(0.2)  # the proxy has relayed the first event
        await resp.write(event[:40])  # half of the next one
        await asyncio.sleep(0.2)
        if fault == "die":
            assert request.transport is not None
            request.transport.abort()
            return resp
        stalling.set()
        await asyncio.sleep(3600)
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", half_event)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        clock = ShiftedClock()  # idle_timeout_s passes on it once the backend stalls (not its pace)
        p = await proxy(baseline=[url], policy="fixed", idle_timeout_s=60, health_checks=False, clock=clock)
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                p.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT, "stream": True}
            ) as r,
        ):
            body = await asyncio.wait_for(clock.ticking(r.read(), 61, when=stalling.is_set), 10)
        events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
        assert events[-1] == b"[DONE]", body
        assert json.loads(events[0])["choices"][0]["delta"]["content"] == "a"
        error = json.loads(events[-2])  # a whole event, not glued to the backend's half one
        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert error["error"]["code"] == "stream_broken"
        await assert_in_flight_zero(p.url)
    finally:
        await runner.cleanup()
