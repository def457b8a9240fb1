"""The hostile probe of issue 25, row by row, through the real `specroute serve` process:
misbehaving backends on raw sockets (`RawBackend`), real clients (aiohttp for the bytes on the
wire, the openai SDK where a client library is the point). Each test checks the bytes the client
got, the status and outcome (`specroute_requests_total`), that no healthy backend was ejected and
that no work was sent twice."""

from __future__ import annotations

import asyncio
import gzip
import json
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from fakes import RAW_COMPLETION, FakeBackend, RawBackend, RawRequest, raw_json_response
from helpers import assert_in_flight_zero, assert_openai_error, metric_samples, peak_rss, wait_until

CHAT = [{"role": "user", "content": "hello"}]
BODY: dict[str, Any] = {"model": "m", "messages": CHAT, "stream": True}
OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


def chunk(text: str) -> bytes:
    payload = {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}}],
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def big_event(size: int) -> bytes:
    """One chat chunk event whose content is `size` bytes."""
    return b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"' + b"y" * size + b'"}}]}\n\n'


def posts(rb: RawBackend) -> list[RawRequest]:
    return [r for r in rb.requests if r.method == "POST"]


Serve = Callable[..., Awaitable[Any]]


async def serve(spawn_serve: Serve, baseline: str, eagle: str | None = None, *extra: str) -> str:
    args = ["--baseline", baseline, "--policy", "fixed", "--policy-param", "pool=baseline"]
    if eagle is not None:
        args += ["--eagle", eagle]
    sp = await spawn_serve(*args, "--health-check-interval-s", "3600", "--log-level", "ERROR", *extra)
    return str(sp.url)


async def requests_total(url: str, backend: str, status: str) -> float:
    samples = await metric_samples(url, "specroute_requests_total")
    return sum(v for k, v in samples.items() if ("backend", backend) in k and ("status", status) in k)


async def ejections(url: str) -> float:
    return sum((await metric_samples(url, "specroute_backend_ejections_total")).values())


async def post_raw(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.read()


# --- K: a hostile usage event in a started stream -----------------------------------------


@pytest.mark.parametrize("usage", ["deep", "digits"])
async def test_k_a_hostile_usage_event_is_relayed_not_a_second_response(spawn_serve, raw_backend, usage):
    count = "[" * 5000 + "]" * 5000 if usage == "deep" else "7" * 5000
    hostile = b'data: {"id":"x","choices":[],"usage":{"completion_tokens":' + count.encode() + b"}}\n\n"

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(OK_HEAD + chunk("a"))
        await w.drain()
        w.write(chunk("b") + hostile + DONE)

    rb = await raw_backend(answer)
    url = await serve(spawn_serve, rb.url)
    status, body = await post_raw(url, BODY)
    assert status == 200
    assert body == chunk("a") + chunk("b") + hostile + DONE  # every byte, one response
    assert b"HTTP/1.1" not in body
    assert await requests_total(url, rb.url, "ok") == 1.0
    await assert_in_flight_zero(url)


async def test_k_a_non_streaming_answer_with_a_5000_digit_count_is_relayed(spawn_serve, raw_backend):
    answer_body = json.dumps({**RAW_COMPLETION, "usage": {"completion_tokens": 0}}).replace(
        "0}", "9" * 5000 + "}"
    )
    raw = answer_body.encode()

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(raw_json_response(raw))

    rb = await raw_backend(answer)
    url = await serve(spawn_serve, rb.url)
    status, body = await post_raw(url, {**BODY, "stream": False})
    assert (status, body) == (200, raw)
    assert await requests_total(url, rb.url, "ok") == 1.0


# --- I: a stream that ends before its end --------------------------------------------------


async def test_i_an_empty_stream_fails_over(spawn_serve, raw_backend, fake_backend):
    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(OK_HEAD)  # then the connection closes: no event, no [DONE]

    rb = await raw_backend(answer)
    good: FakeBackend = await fake_backend()
    url = await serve(spawn_serve, rb.url, good.url)
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    stream = await c.chat.completions.create(model="m", messages=CHAT, stream=True)  # type: ignore[arg-type]
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    assert text  # the other backend's whole answer
    assert len(posts(rb)) == 1 and len(good.requests) == 1
    assert await requests_total(url, good.url, "ok") == 1.0
    failovers = await metric_samples(url, "specroute_failovers_total")
    assert failovers[(("pool", "baseline"),)] == 1.0
    await c.close()


async def test_i_one_event_then_close_fails_over_or_ends_with_an_error(
    spawn_serve, raw_backend, fake_backend
):
    """Whether the close is seen before the first event went out depends on the network; either
    way the client gets one well-formed answer and the cut stream is an error, never `ok`."""

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(OK_HEAD + chunk("a"))

    rb = await raw_backend(answer)
    good: FakeBackend = await fake_backend()
    url = await serve(spawn_serve, rb.url, good.url)
    status, body = await post_raw(url, BODY)
    assert status == 200 and body.endswith(DONE) and body.count(DONE) == 1
    if len(good.requests) == 1:  # seen before the commit: failed over
        assert body.startswith(b"data: ") and b"stream_broken" not in body
        assert await requests_total(url, good.url, "ok") == 1.0
    else:
        assert body.startswith(chunk("a")) and b"stream_broken" in body
        assert await requests_total(url, rb.url, "error") == 1.0
    assert await requests_total(url, rb.url, "ok") == 0.0


async def test_i_a_stream_cut_after_the_commit_ends_with_an_error_event(spawn_serve, raw_backend):
    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(OK_HEAD + chunk("a"))
        await w.drain()
        await asyncio.sleep(0.05)  # the backend's pace, not a timeout: the first event goes out alone
        w.write(chunk("b"))  # and then the connection closes without [DONE]

    rb = await raw_backend(answer)
    url = await serve(spawn_serve, rb.url, None, "--outlier-consecutive-failures", "1")
    status, body = await post_raw(url, BODY)
    assert status == 200
    assert body.startswith(chunk("a") + chunk("b"))
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))
    assert_openai_error(error, "stream_broken")
    assert "without [DONE]" in error["error"]["message"]
    assert await requests_total(url, rb.url, "error") == 1.0
    assert await ejections(url) == 1.0  # a backend that cuts its streams is the faulty one


# --- G: CRLF framing is relayed event by event ----------------------------------------------


@pytest.mark.parametrize("end", [b"\r\n", b"\r"], ids=["crlf", "cr"])
async def test_g_crlf_and_cr_framed_events_are_relayed_as_they_come(spawn_serve, raw_backend, end):
    first_seen = asyncio.Event()

    def ev(data: bytes) -> bytes:
        return b"data: " + data + end + end

    usage = b'{"id":"x","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}'

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(OK_HEAD + ev(chunk("a")[6:-2]))
        await w.drain()
        await asyncio.wait_for(first_seen.wait(), 30)  # the client must see it before the rest exists
        w.write(ev(chunk("b")[6:-2]) + ev(usage) + ev(b"[DONE]"))

    rb = await raw_backend(answer)
    url = await serve(spawn_serve, rb.url)
    got = b""
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=BODY) as r:
        assert r.status == 200
        async for data in r.content.iter_any():
            got += data
            if got.endswith(end + end):
                first_seen.set()
    assert got == ev(chunk("a")[6:-2]) + ev(chunk("b")[6:-2]) + ev(b"[DONE]")  # usage: asked by specroute
    assert await requests_total(url, rb.url, "ok") == 1.0


# --- C: deep JSON and huge numbers where a backend answers ----------------------------------


@pytest.mark.parametrize(
    "first",
    [
        b'data: {"error": ' + b"[" * 5000 + b"]" * 5000 + b"}\n\n",
        b'data: {"error": {"code": ' + b"5" * 400 + b"}}\n\n",
    ],
    ids=["deep", "digits"],
)
async def test_c_a_hostile_first_event_fails_over_and_counts(spawn_serve, raw_backend, fake_backend, first):
    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(OK_HEAD + first + DONE)

    rb = await raw_backend(answer)
    good: FakeBackend = await fake_backend()
    url = await serve(spawn_serve, rb.url, good.url, "--outlier-consecutive-failures", "1")
    status, body = await post_raw(url, BODY)
    assert status == 200 and body.endswith(DONE) and b'"error"' not in body
    assert len(good.requests) == 1
    assert await requests_total(url, good.url, "ok") == 1.0
    assert await ejections(url) == 1.0  # the backend that broke the protocol, not the good one


async def test_c_deep_json_from_server_info_and_generate_is_no_internal_error(spawn_serve, raw_backend):
    deep = b'{"meta_info": ' + b"[" * 5000 + b"]" * 5000 + b"}"

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(raw_json_response(deep))

    rb = await raw_backend(answer)
    url = await serve(spawn_serve, rb.url)
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/server_info") as r:
            assert r.status < 500 or (await r.json())["error"]["code"] != "internal_error"
        status, body = await post_raw(url, {"text": "hi", "stream": False}, "/generate")
    assert (status, body) == (200, deep)  # the backend's answer, as it sent it


# --- B: absurd token counts -----------------------------------------------------------------


@pytest.mark.parametrize(
    "huge", [b"1" + b"0" * 400, b"1e30", b"1e400", b"-1e30"], ids=["digits", "1e30", "inf", "neg"]
)
async def test_b_an_absurd_usage_does_not_lose_the_decision_log_line(
    spawn_serve, raw_backend, tmp_path: Path, huge: bytes
):
    usage = (
        b'{"id":"x","choices":[],"usage":{"prompt_tokens":' + huge + b',"completion_tokens":' + huge + b"}}"
    )

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(OK_HEAD + chunk("a") + b"data: " + usage + b"\n\n" + DONE)

    rb = await raw_backend(answer)
    log_path = tmp_path / "decisions.jsonl"
    url = await serve(spawn_serve, rb.url, None, "--decision-log", str(log_path))
    status, body = await post_raw(url, BODY)
    assert status == 200 and body.endswith(DONE)
    assert await requests_total(url, rb.url, "ok") == 1.0
    for _ in range(100):  # the log is written by a thread: wait for the line, not a time
        if log_path.exists() and log_path.read_text().strip():
            break
        await asyncio.sleep(0.05)
    (line,) = log_path.read_text().splitlines()
    record = json.loads(line)
    assert record["status"] == "ok"
    assert record["completion_tokens"] is None  # an absurd count is not taken ...
    assert (
        sum((await metric_samples(url, "specroute_output_tokens_total")).values()) == 0.0
    )  # ... nor counted


# --- J: long non-streaming requests ---------------------------------------------------------


async def test_j_a_non_streaming_request_is_never_run_twice_nor_blamed(spawn_serve, raw_backend):
    """On the process's driven clock (`tests/driven_serve.py`): realistic limits, no waiting."""
    release = asyncio.Event()

    async def slow(req: RawRequest, w: asyncio.StreamWriter) -> None:
        if b"long" in req.body:
            await release.wait()  # a long generation: longer than the request timeout
        w.write(raw_json_response(json.dumps(RAW_COMPLETION).encode()))

    a, b = await raw_backend(slow), await raw_backend(slow)
    sp = await spawn_serve(
        "--baseline", a.url, "--eagle", b.url, "--policy", "fixed", "--policy-param", "pool=baseline",
        "--health-check-interval-s", "3600", "--log-level", "ERROR", "--first-byte-timeout-s", "10",
        "--request-timeout-s", "60", "--outlier-consecutive-failures", "1",
        driven=True,
    )  # fmt: skip
    long_body = {"model": "m", "messages": [{"role": "user", "content": "long"}]}
    short_body = {"model": "m", "messages": CHAT}
    long_ones = [asyncio.create_task(post_raw(sp.url, long_body)) for _ in range(3)]

    def long_posts() -> list[RawRequest]:
        return [r for r in posts(a) + posts(b) if b"long" in r.body]

    assert await wait_until(lambda: len(long_posts()) == 3)
    await sp.advance_clock(11)  # past the first byte's limit: a stream's would fail over now
    shorts = [await post_raw(sp.url, short_body) for _ in range(5)]  # the backend serves others
    assert all(s == 200 for s, _ in shorts)
    assert not any(t.done() for t in long_ones) and len(long_posts()) == 3
    await sp.advance_clock(50)  # past the request's own limit
    results = await asyncio.gather(*long_ones)
    release.set()
    for status, body in results:
        assert status == 504
        assert_openai_error(json.loads(body), "backend_timeout")
    assert len(long_posts()) == 3  # each sent once: no GPU work doubled
    assert await ejections(sp.url) == 0.0  # the backend served others meanwhile: not its fault


# --- M: overload is not failure -------------------------------------------------------------

QUEUE_FULL = (
    b'data: {"error": {"object": "error", "message": "The request queue is full.", '
    b'"type": "SERVICE_UNAVAILABLE", "param": null, "code": 503}}\n\n' + DONE
)


async def test_m_queue_full_is_backed_off_never_ejected(spawn_serve, raw_backend, fake_backend):
    async def full(req: RawRequest, w: asyncio.StreamWriter) -> None:
        if req.method == "GET":  # its health probe: it is up, only busy
            w.write(raw_json_response(b"{}"))
        elif b'"stream": true' in req.body or b'"stream":true' in req.body:
            w.write(OK_HEAD + QUEUE_FULL)
        else:
            w.write(
                raw_json_response(
                    b'{"object":"error","message":"The request queue is full.","code":503}', "503 Busy"
                )
            )

    rb = await raw_backend(full)
    good: FakeBackend = await fake_backend()
    url = await serve(
        spawn_serve, rb.url, good.url, "--outlier-consecutive-failures", "1", "--overload-backoff-s", "0"
    )
    for stream in (True, False, True, False):
        status, _ = await post_raw(url, {**BODY, "stream": stream})
        assert status == 200
    assert len(posts(rb)) == 4  # every request tried the full backend first (no back-off) ...
    assert await ejections(url) == 0.0  # ... and it was never ejected for being full
    async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
        assert rb.url in (await r.json())["healthy_backends"]


async def test_m_every_backend_full_is_a_503_with_retry_after(spawn_serve, raw_backend):
    async def full(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(OK_HEAD + QUEUE_FULL)

    rb = await raw_backend(full)
    url = await serve(spawn_serve, rb.url)
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=BODY) as r:
        assert r.status == 503 and r.headers["Retry-After"]
        body = await r.json()
    assert_openai_error(body, "backend_overloaded")
    assert "queue" in body["error"]["message"]


# --- a client's mistake ---------------------------------------------------------------------


async def test_a_backend_4xx_is_openai_shaped_and_counted_client_error(spawn_serve, raw_backend):
    sglang = (
        b'{"object":"error","message":"max_tokens must be at least 1","type":"BadRequestError","code":400}'
    )

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(raw_json_response(sglang, "400 Bad Request"))

    rb = await raw_backend(answer)
    url = await serve(spawn_serve, rb.url, None, "--outlier-consecutive-failures", "1")
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    for _ in range(3):
        with pytest.raises(openai.BadRequestError) as info:
            # (the backend refuses whatever it gets; max_tokens 0 itself specroute refuses first)
            await c.chat.completions.create(model="m", messages=CHAT, max_tokens=5)
        assert info.value.code == "invalid_request"
        assert info.value.body["message"] == "max_tokens must be at least 1"  # type: ignore[index]
    assert await requests_total(url, rb.url, "client_error") == 3.0
    assert await ejections(url) == 0.0
    await c.close()


# --- L, L2, H: the memory budget ------------------------------------------------------------

BUDGET = 64 * 1024 * 1024


async def test_l_large_bodies_beyond_the_budget_get_503_not_memory(spawn_serve, fake_backend):
    good: FakeBackend = await fake_backend()
    sp = await spawn_serve(
        "--baseline", good.url, "--policy", "fixed", "--policy-param", "pool=baseline",
        "--memory-budget-bytes", str(BUDGET), "--log-level", "ERROR",
    )  # fmt: skip
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (8 << 20)}]}).encode()

    async def one(s: aiohttp.ClientSession) -> tuple[int, str | None]:
        async with s.post(
            sp.url + "/v1/chat/completions", data=big, headers={"Content-Type": "application/json"}
        ) as r:
            await r.read()
            return r.status, r.headers.get("Retry-After")

    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(one(s) for _ in range(16)))
    statuses = [st for st, _ in results]
    assert set(statuses) <= {200, 503} and 503 in statuses
    assert all(ra for st, ra in results if st == 503)
    assert peak_rss(sp.proc.pid) <= BUDGET + 150 * 1024 * 1024
    async with aiohttp.ClientSession() as s:  # and the budget comes back: a request fits again
        assert (await one(s))[0] == 200


async def test_l2_a_gzip_bomb_is_refused_by_its_ratio(spawn_serve, fake_backend):
    good: FakeBackend = await fake_backend()
    sp = await spawn_serve("--baseline", good.url, "--log-level", "ERROR")
    bomb = gzip.compress(json.dumps({"model": "m", "prompt": "x" * (30 << 20)}).encode())
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(sp.url + "/v1/completions", data=bomb, headers=headers) as r,
    ):
        assert r.status == 413
        assert_openai_error(await r.json(), "payload_too_large")
    assert good.requests == []


async def test_h_huge_first_events_beyond_the_budget_get_502_not_memory(spawn_serve, raw_backend):
    first = big_event(20 << 20)

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(OK_HEAD + first + DONE)

    rb = await raw_backend(answer)
    sp = await spawn_serve(
        "--baseline", rb.url, "--policy", "fixed", "--policy-param", "pool=baseline",
        "--memory-budget-bytes", str(BUDGET), "--health-check-interval-s", "3600", "--log-level", "ERROR",
    )  # fmt: skip
    results = await asyncio.gather(*(post_raw(sp.url, BODY) for _ in range(8)))
    statuses = sorted(st for st, _ in results)
    assert set(statuses) <= {200, 502} and 502 in statuses
    for st, body in results:
        if st == 502:
            assert_openai_error(json.loads(body), "answer_over_memory_budget")
        else:
            assert body == first + DONE
    assert peak_rss(sp.proc.pid) <= BUDGET + 150 * 1024 * 1024
    assert await ejections(sp.url) == 0.0


async def test_h_large_first_events_wait_their_turn_for_the_budget_instead_of_502(spawn_serve, raw_backend):
    """Six streams whose first event is 5 MB, a 64 MiB budget: a first event past 1 MiB is charged
    at once for the largest allowed (capped at half the budget, which one 5 MB event fits), so
    they are read one after the other, each waiting its turn having read about 1 MiB (or less:
    the first MiB waits too when the budget is full); each is relayed whole, none refused
    (charged as they grew, most were refused with 502)."""
    first = big_event(5 << 20)

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(OK_HEAD + first + DONE)

    rb = await raw_backend(answer)
    sp = await spawn_serve(
        "--baseline", rb.url, "--policy", "fixed", "--policy-param", "pool=baseline",
        "--memory-budget-bytes", str(BUDGET), "--health-check-interval-s", "3600", "--log-level", "ERROR",
    )  # fmt: skip
    results = await asyncio.gather(*(post_raw(sp.url, BODY) for _ in range(6)))
    assert results == [(200, first + DONE)] * 6
    assert await requests_total(sp.url, rb.url, "ok") == 6.0
    assert len(posts(rb)) == 6
    assert peak_rss(sp.proc.pid) <= BUDGET + 150 * 1024 * 1024
    await assert_in_flight_zero(sp.url)


async def test_h_a_large_first_event_gets_502_when_no_room_comes_within_the_wait(spawn_serve, raw_backend):
    """Two streams whose backend sends 2 MiB of a 5 MB first event and then waits: the budget
    holds one of them (half of 64 MiB), and with `--admission-wait-s 0` the other is refused at
    once, 502 `answer_over_memory_budget` (nothing reached its client; not retried, no ejection).
    Then the backend finishes the first, which is relayed whole."""
    first = big_event(5 << 20)
    release = asyncio.Event()

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(OK_HEAD + first[: 2 << 20])
        await w.drain()
        await release.wait()
        w.write(first[2 << 20 :] + DONE)

    rb = await raw_backend(answer)
    budget = ("--memory-budget-bytes", str(BUDGET), "--admission-wait-s", "0")
    url = await serve(spawn_serve, rb.url, None, *budget)
    pending = {asyncio.ensure_future(post_raw(url, BODY)) for _ in range(2)}
    done, pending = await asyncio.wait(pending, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    release.set()  # the backend may finish now (both stuck: `done` is empty and the test fails)
    (refused,) = [t.result() for t in done]
    assert refused[0] == 502
    assert_openai_error(json.loads(refused[1]), "answer_over_memory_budget")
    (relayed,) = [await t for t in pending]
    assert relayed == (200, first + DONE)
    assert len(posts(rb)) == 2
    assert await ejections(url) == 0.0
    assert (await metric_samples(url, "specroute_memory_budget_refusals_total"))[()] == 1.0
    await assert_in_flight_zero(url)


async def test_h_large_first_events_leave_room_for_ordinary_answers(spawn_serve, raw_backend):
    """Row H's backend also serves ordinary streams. Two of its 5 MB first events arrive half
    way and stall, each charged for the largest allowed (half of a 64 MiB budget): the first holds
    its half, the second waits (`specroute_memory_budget_waiting`); meanwhile ordinary streams
    get 200, byte for byte, not 502. Then the large ones are relayed whole, in turn, and the
    budget is empty again, having refused nothing."""
    first = big_event(5 << 20)
    small = chunk("fine") + DONE
    release = asyncio.Event()

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        if b"large" not in req.body:
            w.write(OK_HEAD + small)
            return
        w.write(OK_HEAD + first[: 2 << 20])
        await w.drain()
        await release.wait()
        w.write(first[2 << 20 :] + DONE)

    rb = await raw_backend(answer)
    url = await serve(spawn_serve, rb.url, None, "--memory-budget-bytes", str(BUDGET))
    large = {**BODY, "messages": [{"role": "user", "content": "large"}]}
    stalled = [asyncio.ensure_future(post_raw(url, large)) for _ in range(2)]

    async def one_holds_one_waits() -> bool:
        used = (await metric_samples(url, "specroute_memory_budget_used_bytes"))[()]
        waiting = (await metric_samples(url, "specroute_memory_budget_waiting"))[()]
        return used >= BUDGET // 2 and waiting == 1

    assert await wait_until(one_holds_one_waits, 30.0)
    ordinary = await asyncio.gather(*(post_raw(url, BODY) for _ in range(4)))
    assert ordinary == [(200, small)] * 4
    assert not any(t.done() for t in stalled)
    release.set()
    assert [await t for t in stalled] == [(200, first + DONE)] * 2
    assert (await metric_samples(url, "specroute_memory_budget_refusals_total"))[()] == 0.0
    assert await requests_total(url, rb.url, "ok") == 6.0
    await assert_in_flight_zero(url)
    assert (await metric_samples(url, "specroute_memory_budget_used_bytes"))[()] == 0.0


@pytest.mark.parametrize(("end", "member"), [(b"\n\n", b""), (b"\r\n\r\n", b""), (b"\n\n", b'"sglext":{},')])
async def test_h_a_large_first_event_is_relayed_whole_and_the_usage_after_it_stripped(
    spawn_serve, raw_backend, end, member
):
    """A first event of 5 MB (relayed as it was read, about 1 MiB per turn of the event loop; with
    a filter's marker in it, whole), sent in uneven writes with the usage event specroute asked
    for right behind it: the client gets the event byte for byte, no usage event, `[DONE]`;
    counted ok with its tokens."""
    content = b'"choices":[{"index":0,"delta":{"content":"' + b"y" * (5 << 20) + b'"}}]}'
    first = b'data: {"id":"x",' + member + content + end
    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":7}}' + end
    done = b"data: [DONE]" + end

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(OK_HEAD)
        rest = first + usage + done
        for cut in (1, 300_000, 1 << 20, (3 << 20) + 7, len(first) - 1, len(first) + 5):
            w.write(rest[:cut])
            rest = rest[cut:]
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(rest)

    rb = await raw_backend(answer)
    url = await serve(spawn_serve, rb.url)
    status, body = await post_raw(url, BODY)
    assert status == 200
    assert body == first + done
    assert await requests_total(url, rb.url, "ok") == 1.0
    tokens = await metric_samples(url, "specroute_output_tokens_total")
    assert sum(tokens.values()) == 7.0
    await assert_in_flight_zero(url)


async def test_l_a_large_body_reaches_the_backend_byte_for_byte(spawn_serve, raw_backend):
    """A 6 MB request body (sent to the backend about 1 MiB per turn of the event loop) arrives
    whole: the client's bytes, its Content-Length, one request."""
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "lorem ipsum " * 500_000}]})

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(raw_json_response(json.dumps(RAW_COMPLETION).encode()))

    rb = await raw_backend(answer)
    url = await serve(spawn_serve, rb.url)
    headers = {"Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", data=raw, headers=headers) as r,
    ):
        assert r.status == 200
        assert (await r.json())["choices"][0]["message"]["content"] == "hi"
    (got,) = posts(rb)
    assert got.body == raw.encode()
    assert got.header("content-length") == str(len(raw)).encode()
    assert await requests_total(url, rb.url, "ok") == 1.0


# --- issue 22: a stream cut at shutdown ends like a broken one --------------------------------


async def test_a_stream_cut_by_the_drain_timeout_ends_with_the_error_event(spawn_serve, fake_backend):
    fb: FakeBackend = await fake_backend(chunks=10)
    fb.mode = "stall_mid"
    sp = await spawn_serve("--baseline", fb.url, "--policy", "fixed", "--drain-timeout-s", "0.5")
    async with aiohttp.ClientSession() as s, s.post(sp.url + "/v1/chat/completions", json=BODY) as r:
        first = await r.content.readuntil(b"\n\n")
        sp.signal(signal.SIGTERM)
        body = first + await r.read()
    assert await sp.wait(timeout_s=20) == 0
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))
    assert_openai_error(error, "stream_broken")
    assert "shutting down" in error["error"]["message"]
