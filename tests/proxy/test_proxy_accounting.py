"""Exact in-flight accounting: counts follow the requests and return to exactly 0 on every path
(success, backend error, timeout, stream dying, client disconnect), and the threshold policy
sees them."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import openai
from fakes import ShiftedClock
from helpers import BODY, CHAT, wait_until

if TYPE_CHECKING:
    from conftest import RunningProxy
    from fakes import FakeBackend


async def _open_stream(session: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    """Start a stream and read its first event, so the request is certainly in flight."""
    resp = await session.post(url + "/v1/chat/completions", json=BODY)
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    return resp


async def _two_per_pool(
    fake_backend: Callable[..., Awaitable[FakeBackend]],
    proxy: Callable[..., Awaitable[RunningProxy]],
    *,
    chunks: int,
    threshold: int,
    **settings: Any,
) -> tuple[list[FakeBackend], RunningProxy]:
    """Four fakes streaming `chunks` chunks 2 ms apart, two per pool, behind the threshold policy."""
    backends = [await fake_backend(chunks=chunks, delay_s=0.002) for _ in range(4)]
    p = await proxy(
        baseline=[b.url for b in backends[:2]],
        eagle=[b.url for b in backends[2:]],
        policy="threshold",
        policy_params={"threshold": threshold},
        **settings,
    )
    return backends, p


async def test_threshold_first_n_streams_to_eagle_rest_to_baseline(fake_backend, proxy):
    base = await fake_backend(chunks=50, delay_s=0.2)
    eagle = await fake_backend(chunks=50, delay_s=0.2)
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="threshold", policy_params={"threshold": 3}
    )
    async with aiohttp.ClientSession() as s:
        streams = [await _open_stream(s, p.url) for _ in range(5)]
        pools = [r.headers["x-specroute-pool"] for r in streams]
        reasons = [r.headers["x-specroute-reason"] for r in streams]
        assert pools == ["eagle"] * 3 + ["baseline"] * 2
        assert reasons == ["below_threshold"] * 3 + ["above_threshold"] * 2
        assert p.sample("specroute_in_flight_requests", pool="eagle", backend=eagle.url) == 3
        assert p.sample("specroute_in_flight_requests", pool="baseline", backend=base.url) == 2
        for r in streams:
            r.close()
        await p.wait_idle()
    assert p.in_flight_samples() == [0.0, 0.0]
    # The proxy closed each upstream answer before releasing its slot; the backends (on this same
    # loop) notice the closed connections in a later turn of it.
    assert await wait_until(lambda: base.active == 0 and eagle.active == 0, 5)
    assert base.aborted + eagle.aborted == 5  # closing the client aborted the upstream generation


async def test_500_streams_30_percent_abandoned_leave_zero_in_flight(fake_backend, proxy):
    backends, p = await _two_per_pool(fake_backend, proxy, chunks=12, threshold=12)
    rng = random.Random(7)
    plan = [rng.random() < 0.3 for _ in range(500)]
    abandon_after = [rng.randrange(0, 6) for _ in range(500)]
    client = openai.AsyncOpenAI(base_url=p.base_url, api_key="k", max_retries=0)
    gate = asyncio.Semaphore(48)
    completed = 0

    async def one(i: int) -> None:
        nonlocal completed
        async with gate:
            stream = await client.chat.completions.create(
                model="m", messages=CHAT, stream=True, stream_options={"include_usage": True}
            )
            n = 0
            async for _chunk in stream:
                n += 1
                if plan[i] and n > abandon_after[i]:
                    await stream.close()  # the client walks away mid-stream
                    return
            completed += 1

    await asyncio.gather(*(one(i) for i in range(500)))
    await client.close()
    await p.wait_idle()
    samples = p.in_flight_samples()
    assert len(samples) == 4 and all(v == 0.0 for v in samples), samples
    assert sum(b.in_flight_tokens for b in p.tracker) == 0
    assert all(b.active == 0 for b in backends)
    assert completed == 500 - sum(plan)
    statuses: dict[str, float] = {}
    for b in p.tracker:
        for st in ("ok", "client_closed", "error", "timeout"):
            v = p.sample("specroute_requests_total", pool=b.pool, backend=b.name, status=st) or 0.0
            statuses[st] = statuses.get(st, 0.0) + v
    assert sum(statuses.values()) == 500
    assert statuses["error"] == statuses["timeout"] == 0
    # every abandoned stream was noticed as such, unless the proxy had already relayed all of it
    assert 0 < statuses["client_closed"] <= sum(plan)
    assert sum(b.aborted for b in backends) == statuses["client_closed"]


async def test_release_on_every_failure_path(fake_backend, proxy):
    """The two stalls run on the proxy's clock (`ShiftedClock.ticking`): realistic timeouts, no
    waiting. The first byte's limit is far above the silence's, so a tick that ends a stall
    after its first event never finds the first byte late."""
    fb = await fake_backend(chunks=6)
    clock = ShiftedClock()
    p = await proxy(
        baseline=[fb.url], policy="fixed", first_byte_timeout_s=3600, idle_timeout_s=60, health_checks=False,
        request_timeout_s=3600, clock=clock,
    )  # fmt: skip
    ticks = {"stall": 3601.0, "stall_mid": 61.0}  # past the first byte's limit, past the silence's

    async def post() -> tuple[aiohttp.ClientResponse, bytes]:
        async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/chat/completions", json=BODY) as r:
            return r, await r.read()

    expected = {
        "ok": 200,
        "error500": 500,  # no other backend: the backend's status, in OpenAI's shape
        "bad_request": 400,  # the client's mistake: counted client_error, not error
        "queue_full": 503,  # no other backend: 503 with Retry-After (overload, not a failure)
        "stall": 504,
        "die_mid": 200,
        "stall_mid": 200,
    }
    for mode, status in expected.items():
        fb.mode = mode
        p.tracker.set_healthy(fb.url, True)
        r, body = await (clock.ticking(post(), ticks[mode]) if mode in ticks else post())
        assert r.status == status, (mode, body)
        await p.wait_idle()
        assert p.tracker.total_in_flight == 0, mode
        assert p.in_flight_samples() == [0.0], mode
    by_status = {
        st: p.sample("specroute_requests_total", pool="baseline", backend=fb.url, status=st)
        for st in ("ok", "error", "timeout", "client_error")
    }
    assert by_status == {"ok": 1.0, "error": 3.0, "timeout": 2.0, "client_error": 1.0}


async def test_client_disconnect_while_waiting_for_first_byte(fake_backend, proxy):
    fb = await fake_backend()
    fb.mode = "stall"
    p = await proxy(baseline=[fb.url], policy="fixed")
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(p.url + "/v1/chat/completions", json={**BODY, "stream": False}))
        assert await wait_until(lambda: fb.active > 0)  # the fake has seen the request
        assert p.tracker.total_in_flight == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await p.wait_idle()
    assert p.tracker.total_in_flight == 0
    await wait_until(lambda: fb.active == 0, 2.0)
    assert fb.active == 0 and fb.aborted == 1  # the upstream request was closed at once
    assert p.records[-1].outcome.status == "client_closed"


async def test_in_flight_tokens_follow_max_tokens(fake_backend, proxy):
    fb = await fake_backend(chunks=50, delay_s=0.2)
    p = await proxy(eagle=[fb.url], policy="fixed", policy_params={"pool": "eagle"})
    async with aiohttp.ClientSession() as s:
        r1 = await s.post(p.url + "/v1/chat/completions", json={**BODY, "max_tokens": 40})
        r2 = await s.post(p.url + "/v1/chat/completions", json={**BODY, "max_completion_tokens": 7})
        await r1.content.readuntil(b"\n\n")
        await r2.content.readuntil(b"\n\n")
        state = p.tracker.get(fb.url)
        assert (state.in_flight, state.in_flight_tokens) == (2, 47)
        view = p.tracker.view(0.0)
        assert view.eagle.backends[0].in_flight == 2
        r1.close()
        r2.close()
    await p.wait_idle()
    assert (state.in_flight, state.in_flight_tokens) == (0, 0)


async def test_chaos_mix_of_failures_and_abandons_leaves_zero_in_flight(fake_backend, proxy):
    """Random per-request backend behaviour (errors, queue-full, stalls, deaths mid-stream) and random
    client abandonment, streaming and not, on both pools at once. The stalls end by the proxy's
    timeouts on its clock, moved on only when every request the proxy has in flight is one a
    backend is stalling: then the minute's limits pass at once and no other request is cut."""
    clock = ShiftedClock()
    backends, p = await _two_per_pool(
        fake_backend,
        proxy,
        chunks=6,
        threshold=6,
        first_byte_timeout_s=60,
        request_timeout_s=60,
        idle_timeout_s=60,
        body_timeout_s=3600,  # limits no tick may reach: only the stalls' end
        admission_wait_s=3600,  # (a wait for a queue-full back-off to end)
        health_check_timeout_s=3600,
        health_check_interval_s=0.1,
        clock=clock,
    )
    rng = random.Random(11)
    modes = ["ok"] * 6 + ["error500", "bad_request", "queue_full", "stall", "die_mid", "stall_mid"]
    gate = asyncio.Semaphore(32)
    statuses: list[int] = []
    stalls = 0

    def only_stalls() -> bool:
        held = [p.tracker.get(b.url).in_flight for b in backends]
        return sum(held) > 0 and held == [b.stalled for b in backends]

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal stalls
        body = {**BODY, "stream": rng.random() < 0.8, "fake_mode": rng.choice(modes)}
        abandon = rng.random() < 0.2
        stalls += body["fake_mode"] == "stall"
        async with gate:
            async with session.post(p.url + "/v1/chat/completions", json=body) as r:
                statuses.append(r.status)
                if abandon:
                    await r.content.readany()
                    r.close()
                    return
                await r.read()

    async with aiohttp.ClientSession() as s:
        await clock.ticking(asyncio.gather(*(one(s) for _ in range(300))), 61, when=only_stalls)
    await p.wait_idle()
    assert p.in_flight_samples() == [0.0] * 4
    assert sum(b.in_flight_tokens for b in p.tracker) == 0
    assert len(statuses) == 300 and set(statuses) <= {200, 400, 500, 502, 503, 504}
    assert statuses.count(504) == stalls > 0  # each stall timed out (on both pools), nothing else did
    await wait_until(lambda: all(b.active == 0 for b in backends), 3.0)
    assert [b.active for b in backends] == [0, 0, 0, 0]
    total = sum(
        p.sample("specroute_requests_total", pool=b.pool, backend=b.name, status=st) or 0.0
        for b in p.tracker
        for st in ("ok", "error", "timeout", "client_closed", "client_error")
    )
    assert total + (p.sample("specroute_rejected_requests_total", code="503") or 0.0) == 300
