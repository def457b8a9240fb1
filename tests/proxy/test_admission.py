"""Admission control: in-flight bounds per backend (by default from the profile's
max_running_requests plus a margin), a full backend routed around, a bounded wait in the proxy
when every usable backend is full, routing with the load as it is when a slot frees, then 429
with Retry-After in OpenAI's error shape; metrics for waits and rejections."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
from fakes import POLL_S, ShiftedClock
from helpers import CHAT, assert_openai_error, wait_until


async def _hold(c: openai.AsyncOpenAI, **kw: Any) -> Any:
    """A stream whose first chunk has arrived: it holds its slot until closed."""
    stream = await c.chat.completions.create(model="m", messages=CHAT, stream=True, max_tokens=10_000, **kw)
    await stream.__anext__()
    return stream


async def _one(c: openai.AsyncOpenAI, **kw: Any) -> tuple[str, str]:
    raw = await c.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=2, **kw)
    return raw.headers["x-specroute-pool"], raw.headers["x-specroute-reason"]


async def test_bounds_default_from_the_profile_plus_margin(fake_backend, proxy):
    base, eagle = await fake_backend(), await fake_backend()
    p = await proxy(
        baseline=[base.url],
        eagle=[eagle.url],
        policy="cost_model",
        profile="kimi-k25-int4-8gpu",
        health_checks=False,
    )
    # kimi-k25-int4-8gpu: max_running_requests 256 (baseline), 48 (eagle); margin 25 %
    assert p.sample("specroute_backend_max_in_flight", pool="baseline", backend=base.url) == 320.0
    assert p.sample("specroute_backend_max_in_flight", pool="eagle", backend=eagle.url) == 60.0
    explicit = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="fixed", profile="kimi-k25-int4-8gpu",
        eagle_backend_max_in_flight=0, baseline_backend_max_in_flight=7, health_checks=False,
    )  # fmt: skip
    assert explicit.sample("specroute_backend_max_in_flight", pool="baseline", backend=base.url) == 7.0
    assert (
        explicit.sample("specroute_backend_max_in_flight", pool="eagle", backend=eagle.url) is None
    )  # 0: none


async def test_a_full_backend_is_routed_around(fake_backend, proxy):
    base, eagle = await fake_backend(delay_s=0.05), await fake_backend(delay_s=0.05)
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="fixed", policy_params={"pool": "eagle"},
        eagle_backend_max_in_flight=1, health_checks=False,
    )  # fmt: skip
    c = p.client()
    held = await _hold(c)
    assert await _one(c) == ("baseline", "eagle_unavailable")  # no wait: the other pool has room
    await held.close()
    await p.wait_idle()
    assert await _one(c) == ("eagle", "fixed_eagle")
    await c.close()
    assert p.sample("specroute_admission_waits_total") == 0.0


async def test_a_request_waits_for_a_slot_and_takes_the_one_that_frees(fake_backend, proxy):
    base, eagle = await fake_backend(delay_s=0.05), await fake_backend(delay_s=0.05)
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="fixed", policy_params={"pool": "eagle"},
        eagle_backend_max_in_flight=1, baseline_backend_max_in_flight=1, health_checks=False,
    )  # fmt: skip
    c = p.client()
    on_eagle = await _hold(c)
    on_base = await _hold(c)  # eagle is full: routed around to baseline
    waiter = asyncio.create_task(_one(c))
    assert await wait_until(lambda: p.sample("specroute_admission_waiting_requests") == 1.0, 5)
    await asyncio.sleep(0.2)
    assert not waiter.done() and len(eagle.requests) == len(base.requests) == 1
    await on_base.close()  # a baseline slot frees: the waiter is routed with the load as it is now
    assert await asyncio.wait_for(waiter, 10) == ("baseline", "eagle_unavailable")
    await on_eagle.close()
    await c.close()
    await p.wait_idle()
    assert p.sample("specroute_admission_waits_total") == 1.0
    assert p.sample("specroute_admission_wait_seconds_count", outcome="admitted") == 1.0
    assert p.sample("specroute_admission_waiting_requests") == 0.0


async def test_a_forced_pool_waits_for_its_own_slot(fake_backend, proxy):
    base, eagle = await fake_backend(delay_s=0.05), await fake_backend(delay_s=0.05)
    p = await proxy(
        baseline=[base.url],
        eagle=[eagle.url],
        policy="fixed",
        eagle_backend_max_in_flight=1,
        health_checks=False,
        allow_client_override=True,
    )
    c = p.client()
    held = await _hold(c, extra_headers={"x-specroute-mode": "eagle"})
    waiter = asyncio.create_task(_one(c, extra_headers={"x-specroute-mode": "eagle"}))
    assert await wait_until(lambda: p.sample("specroute_admission_waiting_requests") == 1.0, 5)
    assert await _one(c) == ("baseline", "fixed_baseline")  # others are not held up
    await held.close()
    assert await asyncio.wait_for(waiter, 10) == ("eagle", "client_override")
    await c.close()


async def test_past_the_wait_a_429_with_retry_after(fake_backend, proxy):
    """A request that finds every backend full waits `admission_wait_s` (10 s, on the proxy's
    clock), not less, then gets 429."""
    base = await fake_backend(chunks=1000, delay_s=0.05)  # the held stream outlasts the test
    clock = ShiftedClock()
    p = await proxy(
        baseline=[base.url], policy="fixed", baseline_backend_max_in_flight=1, admission_wait_s=10,
        health_checks=False, clock=clock,
    )  # fmt: skip
    c = p.client()
    held = await _hold(c)
    waiting = asyncio.ensure_future(_one(c))
    assert await wait_until(lambda: p.sample("specroute_admission_waiting_requests") == 1.0, 10)
    clock.advance(9)
    await asyncio.sleep(2 * POLL_S)  # the wait's timer (due within POLL_S) has checked since
    assert not waiting.done(), "refused before admission_wait_s"
    clock.advance(2)
    with pytest.raises(openai.RateLimitError) as info:
        await asyncio.wait_for(waiting, 5)
    assert info.value.status_code == 429
    assert info.value.response.headers["Retry-After"] == "1"
    assert_openai_error(info.value.response.json(), "rate_limit_exceeded")
    assert p.sample("specroute_admission_rejections_total") == 1.0
    assert p.sample("specroute_rejected_requests_total", code="429") == 1.0
    assert p.sample("specroute_admission_wait_seconds_count", outcome="rejected") == 1.0
    await held.close()
    await c.close()


async def test_with_the_waiting_room_full_a_429_at_once(fake_backend, proxy):
    base = await fake_backend(delay_s=0.05)
    p = await proxy(
        baseline=[base.url], policy="fixed", baseline_backend_max_in_flight=1, admission_max_waiting=0,
        health_checks=False,
    )  # fmt: skip
    c = p.client()
    held = await _hold(c)
    async with aiohttp.ClientSession() as s:
        body = {"model": "m", "messages": CHAT}
        async with s.post(p.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            assert_openai_error(await r.json(), "rate_limit_exceeded")
    assert p.sample("specroute_admission_waits_total") == 0.0
    await held.close()
    await c.close()


async def test_a_waiting_client_that_leaves_frees_its_place(fake_backend, proxy):
    base = await fake_backend(delay_s=0.05)
    p = await proxy(
        baseline=[base.url], policy="fixed", baseline_backend_max_in_flight=1, health_checks=False
    )
    c = p.client()
    held = await _hold(c)
    waiter = asyncio.create_task(_one(c))
    assert await wait_until(lambda: p.sample("specroute_admission_waiting_requests") == 1.0, 5)
    waiter.cancel()
    assert await wait_until(lambda: p.sample("specroute_admission_waiting_requests") == 0.0, 5)
    assert p.sample("specroute_admission_wait_seconds_count", outcome="client_closed") == 1.0
    await held.close()
    await p.wait_idle()
    assert p.in_flight_samples() == [0.0]
    assert await _one(c) == ("baseline", "fixed_baseline")
    await c.close()
