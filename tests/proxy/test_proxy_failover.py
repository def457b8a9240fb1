"""Failover before the first byte, health (passive and active), and streams that break after it."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
from aiohttp import web
from fakes import POLL_S, SSE_DONE, ShiftedClock, closed_port_url, sse, stream_chunk
from helpers import BODY, CHAT, wait_until


async def test_dead_backend_is_skipped_without_client_visible_error(fake_backend, proxy):
    live = await fake_backend(chunks=3)
    dead = closed_port_url()
    p = await proxy(
        baseline=[dead, live.url], eagle=[], policy="fixed", health_checks=False, seed=1,
        outlier_consecutive_failures=1,
    )  # fmt: skip
    client = openai.AsyncOpenAI(base_url=p.base_url, api_key="k", max_retries=0)
    for i in range(6):
        stream = i % 2 == 0
        if stream:
            chunks = [
                c async for c in await client.chat.completions.create(model="m", messages=CHAT, stream=True)
            ]
            assert chunks[1].choices[0].delta.content == "tok0 "
        else:
            out = await client.chat.completions.create(model="m", messages=CHAT)
            assert out.choices[0].message.content == "tok0 tok1 tok2 "
    await client.close()
    assert len(live.requests) == 6
    # ejected after the refused connection (outlier_consecutive_failures=1); no probe ran
    assert p.sample("specroute_backend_ejected", pool="baseline", backend=dead) == 1.0
    assert p.sample("specroute_backend_ejections_total", pool="baseline", backend=dead) == 1.0
    assert p.sample("specroute_failovers_total", pool="baseline") in (None, 1.0)
    assert p.tracker.total_in_flight == 0


async def test_failover_goes_to_other_pool_and_headers_say_so(fake_backend, proxy):
    eagle = await fake_backend()
    base = await fake_backend()
    eagle_url = eagle.url
    await eagle.stop()  # refuses connections now
    p = await proxy(
        baseline=[base.url],
        eagle=[eagle_url],
        policy="fixed",
        policy_params={"pool": "eagle"},
        health_checks=False,
        outlier_consecutive_failures=1,
    )
    async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/chat/completions", json=BODY) as r:
        body = await r.read()
    assert r.status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert (r.headers["x-specroute-pool"], r.headers["x-specroute-reason"]) == ("baseline", "failover")
    assert p.records[-1].chosen.pool == "eagle" and p.records[-1].outcome.decision.pool == "baseline"
    assert p.sample("specroute_failovers_total", pool="eagle") == 1.0
    # the next request is routed around the unhealthy eagle backend by the policy itself
    async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/chat/completions", json=BODY) as r:
        await r.read()
    assert r.headers["x-specroute-reason"] == "eagle_unavailable"


async def test_queue_full_first_event_and_5xx_are_retried_once(fake_backend, proxy):
    a = await fake_backend()
    b = await fake_backend()
    p = await proxy(baseline=[a.url, b.url], policy="fixed", health_checks=False)
    for mode in ("queue_full", "error500"):
        a.mode = b.mode = mode
        b.mode = "ok"
        for stream in (True, False):
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    p.url + "/v1/chat/completions",
                    json={**BODY, "stream": stream},
                    headers={"x-specroute-mode": "baseline"},
                ) as r,
            ):
                body = await r.read()
            assert r.status == 200, (mode, stream, body)
            assert r.headers["x-specroute-backend"] == b.url
            assert b"error" not in body
            assert p.tracker.get(a.url).healthy  # overload is not ill health
    # both full: 503 with Retry-After in OpenAI's shape (overload: the client may retry soon)
    a.mode = b.mode = "queue_full"
    async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/chat/completions", json=BODY) as r:
        body = await r.read()
    assert r.status == 503 and r.headers["Retry-After"] == "1"
    assert json.loads(body)["error"]["code"] == "backend_overloaded"
    assert p.tracker.get(a.url).healthy and p.tracker.get(b.url).healthy
    assert p.tracker.total_in_flight == 0


async def test_first_byte_timeout_retries_then_504(fake_backend, proxy):
    """On the proxy's clock (`ShiftedClock.ticking`): a minute's first-byte timeout, no waiting."""
    slow = await fake_backend()
    slow.mode = "stall"
    fast = await fake_backend()
    clock = ShiftedClock()
    p = await proxy(
        baseline=[slow.url], eagle=[fast.url], policy="fixed", first_byte_timeout_s=60, health_checks=False,
        outlier_consecutive_failures=1, clock=clock,
        idle_timeout_s=3600,  # a tick (61 s) while fast's stream is relayed must not cut it
    )  # fmt: skip

    async def post() -> tuple[aiohttp.ClientResponse, bytes]:
        async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/chat/completions", json=BODY) as r:
            return r, await r.read()

    r, _ = await clock.ticking(post(), 61)
    assert r.status == 200 and r.headers["x-specroute-pool"] == "eagle"
    assert p.tracker.get(slow.url).ejected_until is not None
    fast.mode = "stall"
    p.tracker.get(slow.url).ejected_until = None  # back in service
    r, body = await clock.ticking(post(), 61)
    err = json.loads(body)
    assert r.status == 504 and err["error"]["code"] == "backend_timeout"
    await p.wait_idle()
    assert p.tracker.total_in_flight == 0
    # the upstream requests were closed, so the backends stopped generating
    await wait_until(lambda: slow.active == fast.active == 0, 2.0)
    assert slow.active == fast.active == 0


async def test_nothing_is_retried_after_the_first_byte(fake_backend, proxy):
    a = await fake_backend(chunks=6)
    b = await fake_backend(chunks=6)
    a.mode = b.mode = "die_mid"
    p = await proxy(baseline=[a.url, b.url], policy="fixed", health_checks=False)
    async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/chat/completions", json=BODY) as r:
        body = await r.read()
    assert r.status == 200
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    err = json.loads(events[-2].removeprefix(b"data: "))
    assert err["error"]["code"] == "stream_broken" and err["error"]["param"] is None
    assert len(a.requests) + len(b.requests) == 1
    assert p.records[-1].outcome.status == "error"


async def test_idle_timeout_after_first_byte_ends_stream_with_error(fake_backend, proxy):
    """A backend that goes silent mid-stream for `idle_timeout_s` (60 s, on the proxy's clock:
    moved on only while it stalls and the client has what it sent) is cut with an error event."""
    fb = await fake_backend(chunks=6)
    fb.mode = "stall_mid"
    clock = ShiftedClock()
    p = await proxy(baseline=[fb.url], policy="fixed", idle_timeout_s=60, clock=clock)
    client = openai.AsyncOpenAI(base_url=p.base_url, api_key="k", max_retries=0)
    stream = await client.chat.completions.create(model="m", messages=CHAT, stream=True)
    got = []

    async def consume() -> str:
        try:
            async for c in stream:
                got.append(c)
        except openai.APIError as e:
            return str(e)
        raise AssertionError("the stream should end with an error event")

    # role chunk + 2 content chunks arrived before the silence
    ticking = clock.ticking(consume(), 61, when=lambda: fb.stalled == 1 and len(got) == 3)
    error = await asyncio.wait_for(ticking, 10)
    assert "sent nothing for 60 s" in error
    await client.close()
    assert len(got) == 3
    await p.wait_idle()
    assert p.records[-1].outcome.status == "timeout"
    assert p.tracker.total_in_flight == 0


async def test_no_healthy_backend_answers_503_quickly(fake_backend, proxy):
    p = await proxy(
        baseline=[closed_port_url()],
        eagle=[closed_port_url()],
        policy="threshold",
        health_check_interval_s=60,
        panic_routing=False,  # else requests are tried on the backends anyway (see test_panic_*)
    )
    await wait_until(lambda: not any(b.healthy for b in p.tracker), 2.0)
    async with aiohttp.ClientSession() as s:
        async with s.post(p.url + "/v1/chat/completions", json=BODY) as r:
            err = await r.json()
        async with s.get(p.url + "/ready") as ready:
            await ready.read()
    assert r.status == 503 and err["error"]["code"] == "no_healthy_backend"
    assert ready.status == 503
    assert p.sample("specroute_rejected_requests_total", code="503") == 1.0


async def test_active_health_check_brings_backend_back(fake_backend, proxy):
    fb = await fake_backend()
    fb.health_status = 503
    p = await proxy(baseline=[fb.url], policy="fixed", health_check_interval_s=0.05)
    await wait_until(lambda: not p.tracker.get(fb.url).healthy, 2.0)
    assert not p.tracker.get(fb.url).healthy
    fb.health_status = 200
    await wait_until(lambda: p.tracker.get(fb.url).healthy, 2.0)
    assert p.tracker.get(fb.url).healthy
    assert p.sample("specroute_backend_healthy", pool="baseline", backend=fb.url) == 1.0


async def test_forced_pool_is_kept_on_failover(fake_backend, proxy):
    base = await fake_backend()
    eagle = await fake_backend()
    eagle.mode = "error500"
    p = await proxy(
        baseline=[base.url],
        eagle=[eagle.url],
        policy="fixed",
        health_checks=False,
        allow_client_override=True,
    )
    async with (
        aiohttp.ClientSession() as s,
        s.post(p.url + "/v1/chat/completions", json=BODY, headers={"x-specroute-mode": "eagle"}) as r,
    ):
        await r.read()
    assert r.status == 500 and r.headers["x-specroute-pool"] == "eagle"
    assert len(base.requests) == 0


async def test_a_silence_shorter_than_the_idle_timeout_is_never_cut(proxy):
    """The idle timer is re-armed lazily, not per chunk: a chunk that arrives just after a re-arm
    must still buy the stream a full `idle_timeout_s` of silence. The proxy's clock is moved on
    by 7.4 s of the 8 s instead of the test sleeping for them; a silence past the limit on the
    same clock cuts the stream (the control)."""
    idle = 8.0
    clock = ShiftedClock()
    go = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse(stream_chunk("r", "m", True, None, role=True)))
        await asyncio.sleep(0.2)  # inside the first re-arm interval
        await resp.write(sse(stream_chunk("r", "m", True, "a")))
        await go.wait()
        await resp.write(sse(stream_chunk("r", "m", True, None, finish="stop")) + SSE_DONE)
        await resp.write_eof()
        return resp

    async def silent_for(seconds: float) -> bytes:
        go.clear()
        async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/chat/completions", json=BODY) as r:
            first = await r.content.readuntil(b"\n\n") + await r.content.readuntil(b"\n\n")
            clock.advance(seconds)
            # the watchdog's timer is due within POLL_S, this sleep's later: it has checked once
            # the clock moved by the time the sleep ends (the loop runs its timers in order)
            await asyncio.sleep(2 * POLL_S)
            go.set()
            return first + await r.read()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        p = await proxy(baseline=[url], policy="fixed", idle_timeout_s=idle, health_checks=False, clock=clock)
        body = await silent_for(7.4)  # with the 0.1 s slept: 7.5 s, shorter than idle_timeout_s
        assert b"stream_broken" not in body and b"sent nothing" not in body, body
        assert body.endswith(b'"finish_reason":"stop","matched_stop":null}]}\n\ndata: [DONE]\n\n')
        await p.wait_idle()
        assert p.records[-1].outcome.status == "ok"
        body = await silent_for(8.5)  # past it, on the same clock
        assert b"sent nothing for 8 s" in body and body.endswith(b"data: [DONE]\n\n"), body
        await p.wait_idle()
        assert p.records[-1].outcome.status == "timeout"
    finally:
        await runner.cleanup()
