"""`request_timeout_s` (issue 25, row J) on the proxy's injected clock (`ShiftedClock`): a test
moves time past a deadline instead of waiting for it, so realistic limits (a minute to the
first byte, ten minutes per non-streaming request) are tested in a fraction of a second.

A non-streaming request is timed by `request_timeout_s`, never by `first_byte_timeout_s`; when it
times out it is answered 504 and never sent to a second backend (the first may still be
generating: no GPU work doubled); the timeout holds the backend to account only if it served
nobody meanwhile. The wire behaviour through the real `serve` process is
`test_hostile_backends_live.py::test_j_a_non_streaming_request_is_never_run_twice_nor_blamed`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from fakes import POLL_S, RAW_COMPLETION, RawBackend, RawRequest, ShiftedClock, raw_json_response
from helpers import assert_openai_error, metric_samples, wait_until

FIRST_BYTE_S = 60.0
REQUEST_S = 600.0
LONG = {"model": "m", "messages": [{"role": "user", "content": "long"}]}
SHORT = {"model": "m", "messages": [{"role": "user", "content": "short"}]}


def long_posts(*backends: RawBackend) -> list[RawRequest]:
    return [r for rb in backends for r in rb.requests if r.method == "POST" and b"long" in r.body]


async def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.read()


async def ejections(url: str) -> float:
    return sum((await metric_samples(url, "specroute_backend_ejections_total")).values())


async def pair(raw_backend: Any, proxy: Any, clock: ShiftedClock, release: asyncio.Event) -> tuple[Any, ...]:
    """A baseline and an eagle backend that hold "long" requests until `release` and answer the
    others at once; the proxy routes everything to baseline, one failure ejects."""

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        if b"long" in req.body:
            await release.wait()
        w.write(raw_json_response(json.dumps(RAW_COMPLETION).encode()))

    a, b = await raw_backend(answer), await raw_backend(answer)
    p = await proxy(
        baseline=[a.url], eagle=[b.url], policy="fixed", policy_params={"pool": "baseline"},
        first_byte_timeout_s=FIRST_BYTE_S, request_timeout_s=REQUEST_S, outlier_consecutive_failures=1,
        health_checks=False, clock=clock,
    )  # fmt: skip
    return a, b, p


async def test_a_non_streaming_request_times_out_once_and_a_busy_backend_is_not_blamed(raw_backend, proxy):
    clock, release = ShiftedClock(), asyncio.Event()
    a, b, p = await pair(raw_backend, proxy, clock, release)
    longs = [asyncio.create_task(post(p.url, LONG)) for _ in range(3)]
    assert await wait_until(lambda: len(long_posts(a)) == 3)
    clock.advance(2 * FIRST_BYTE_S)  # past first_byte_timeout_s: no limit of a non-streaming request
    await asyncio.sleep(3 * POLL_S)  # (the deadlines on a shifted clock are checked every POLL_S)
    assert not any(t.done() for t in longs)
    shorts = [await post(p.url, SHORT) for _ in range(5)]  # the backend serves others meanwhile
    assert [s for s, _ in shorts] == [200] * 5
    clock.advance(REQUEST_S)
    results = await asyncio.gather(*longs)
    release.set()
    for status, body in results:
        assert status == 504
        assert_openai_error(json.loads(body), "backend_timeout")
    assert len(long_posts(a, b)) == 3  # each sent once, never re-run on eagle
    await p.wait_idle()
    assert await ejections(p.url) == 0.0  # it served others: slow work, not a faulty backend
    assert [r.outcome.status for r in p.records].count("timeout") == 3
    assert len(p.tracker.usable(clock())) == 2  # both backends still take requests


async def test_a_timeout_on_a_backend_that_served_nobody_ejects_it(raw_backend, proxy):
    """The control: the same timeout with no progress on the backend meanwhile counts."""
    clock, release = ShiftedClock(), asyncio.Event()
    a, b, p = await pair(raw_backend, proxy, clock, release)
    task = asyncio.create_task(post(p.url, LONG))
    assert await wait_until(lambda: len(long_posts(a)) == 1)
    clock.advance(REQUEST_S)
    status, body = await task
    release.set()
    assert status == 504
    assert_openai_error(json.loads(body), "backend_timeout")
    assert len(long_posts(a, b)) == 1
    assert await ejections(p.url) == 1.0
    assert [s.name for s in p.tracker.usable(clock())] == [b.url]


async def test_a_non_streaming_answer_slower_than_first_byte_timeout_s_is_served(raw_backend, proxy):
    clock, release = ShiftedClock(), asyncio.Event()
    a, b, p = await pair(raw_backend, proxy, clock, release)
    task = asyncio.create_task(post(p.url, LONG))
    assert await wait_until(lambda: len(long_posts(a)) == 1)
    clock.advance(5 * FIRST_BYTE_S)  # a long generation, well within request_timeout_s
    await asyncio.sleep(3 * POLL_S)
    assert not task.done()
    release.set()
    status, body = await task
    assert status == 200 and json.loads(body) == RAW_COMPLETION
    assert len(long_posts(a, b)) == 1
    await p.wait_idle()
    assert p.records[-1].outcome.status == "ok"
    assert await ejections(p.url) == 0.0
