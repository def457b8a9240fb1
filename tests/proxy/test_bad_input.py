"""Hostile or broken clients: wrong types, bodies over the limit or nested too deeply, invalid
UTF-8, oversized headers, slowloris (headers or body never finished) and 2,000 idle connections.
Each gets a fitting 4xx (OpenAI-shaped when the request got as far as specroute's handler) or is
closed by a timeout, and a normal request succeeds meanwhile. Raw sockets (asyncio streams) speak
the broken HTTP; the official openai client is the well-behaved neighbour."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import random
import resource
import signal
import socket
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from fakes import POLL_S, ShiftedClock
from helpers import BODY, CHAT, assert_openai_error, metric_samples, raise_open_files_limit, wait_until
from helpers import port_of as _port
from helpers import raw_exchange as _raw
from helpers import raw_post as _request


async def _normal_request(base_url: str) -> None:
    """A well-behaved client: a streaming chat completion through the official client."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=20)
    try:
        stream = await client.chat.completions.create(model="m", messages=CHAT, stream=True)
        chunks = [c async for c in stream]
    finally:
        await client.close()
    assert chunks[1].choices[0].delta.content == "tok0 "


def _split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        out = b""
        while body:
            size_line, _, body = body.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out, body = out + body[:size], body[size + 2 :]
        body = out
    return status, headers, body


@pytest.mark.parametrize(
    ("path", "data", "needle"),
    [
        ("/v1/chat/completions", b'{"messages": [], "max_tokens": "ten"}', "max_tokens"),
        ("/v1/chat/completions", b'{"messages": [], "max_tokens": -1}', "max_tokens"),
        ("/v1/chat/completions", b'{"messages": [], "max_tokens": true}', "max_tokens"),
        ("/v1/chat/completions", b'{"messages": [], "max_tokens": 1e400}', "max_tokens"),
        ("/v1/chat/completions", b'{"messages": [], "max_completion_tokens": 2.5}', "max_completion_tokens"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": [1]}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "stream": 1}', "stream"),
        ("/v1/completions", b'{"max_tokens": 4}', "prompt"),
        ("/v1/chat/completions", b'{"messages": null}', "messages"),
        ("/v1/chat/completions", b"null", "JSON object"),
        ("/v1/chat/completions", b"42", "JSON object"),
        ("/v1/chat/completions", b"", "not valid JSON"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
            "not valid JSON",
        ),
        ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
    ],
)
async def test_wrong_types_and_broken_json_get_400(fake_backend, proxy, path, data, needle):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False)
    async with (
        aiohttp.ClientSession() as s,
        s.post(p.url + path, data=data, headers={"Content-Type": "application/json"}) as r,
    ):
        body = await r.json()
    assert r.status == 400, body
    assert_openai_error(body, "invalid_request")
    assert needle in body["error"]["message"]
    assert fb.requests == []
    assert p.in_flight_samples() == [0.0]


async def test_integral_float_max_tokens_and_null_are_accepted(fake_backend, proxy):
    fb = await fake_backend(chunks=3)
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False)
    async with aiohttp.ClientSession() as s:
        for extra in ({"max_tokens": 2.0}, {"max_tokens": None}, {"max_completion_tokens": 1}):
            async with s.post(p.url + "/v1/chat/completions", json={**BODY, **extra}) as r:
                assert r.status == 200, await r.text()
                assert (await r.read()).endswith(b"data: [DONE]\n\n")


async def test_body_over_limit_without_content_length_gets_413(fake_backend, proxy):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", body_limit_bytes=4096, health_checks=False)

    async def chunks():  # chunked upload: the size is only known while reading
        for _ in range(64):
            yield b"x" * 1024

    async with (
        aiohttp.ClientSession() as s,
        s.post(p.url + "/v1/chat/completions", data=chunks()) as r,
    ):
        body = await r.json()
    assert r.status == 413
    assert_openai_error(body, "payload_too_large")
    assert fb.requests == []
    await _normal_request(p.base_url)
    assert p.in_flight_samples() == [0.0]


async def test_invalid_utf8_in_headers_and_path(fake_backend, proxy):
    fb = await fake_backend(chunks=2)
    p = await proxy(baseline=[fb.url], policy="fixed", admin_token="t0ken", health_checks=False)
    port = _port(p.url)
    body = json.dumps({**BODY, "stream": False}).encode()
    for header in (b"X-Note: \xff\xfe\r\n", b"Authorization: Bearer \xff\r\n", b"x-specroute-mode: \xe9\r\n"):
        status, _, answer = _split_response(await _raw(port, _request("/v1/chat/completions", body, header)))
        assert status in (200, 400), (header, status, answer)
        assert b"Traceback" not in answer
        if status == 400:
            assert_openai_error(json.loads(answer), "invalid_request")
    status, _, answer = _split_response(
        await _raw(
            port,
            b"GET /admin/policy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Authorization: Bearer \xff\xfe\r\n\r\n",
        )
    )
    assert status == 401, answer
    assert_openai_error(json.loads(answer), "invalid_api_key")
    status, _, answer = _split_response(
        await _raw(port, b"GET /v1/\xff\xfe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    )
    assert 400 <= status < 500 and b"Traceback" not in answer
    await _normal_request(p.base_url)
    assert p.in_flight_samples() == [0.0]


async def test_oversized_header_and_too_many_headers_get_400(fake_backend, proxy):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False)
    port = _port(p.url)
    body = json.dumps(BODY).encode()
    big = b"X-Big: " + b"a" * 20_000 + b"\r\n"
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(500))
    for extra in (big, many):
        status, _, answer = _split_response(await _raw(port, _request("/v1/chat/completions", body, extra)))
        # rejected by aiohttp's HTTP parser before any handler runs: a plain-text 400, no traceback
        assert status == 400
        assert b"Traceback" not in answer and len(answer) < 1024
    long_line = (
        b"POST /v1/chat/completions?" + b"q" * 20_000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    status, _, answer = _split_response(await _raw(port, long_line))
    assert status in (400, 414) and b"Traceback" not in answer
    assert fb.requests == []
    await _normal_request(p.base_url)
    assert p.in_flight_samples() == [0.0]


async def test_slowloris_headers_are_cut_by_the_header_timeout(fake_backend, proxy):
    fb = await fake_backend(chunks=2)
    p = await proxy(baseline=[fb.url], policy="fixed", header_timeout_s=0.5, health_checks=False)
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(p.url))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    t0 = loop.time()
    closed = asyncio.create_task(reader.read())
    closed_after = None
    try:
        for i in range(100):  # one header line every 50 ms, never the blank line
            if closed.done():
                closed_after = loop.time() - t0
                break
            if i == 3:
                await _normal_request(p.base_url)  # served while the slow client holds its socket
            writer.write(b"X-Slow-%d: x\r\n" % i)
            await asyncio.sleep(0.05)
    finally:
        writer.close()
        closed.cancel()
    # closed while the client was still sending header lines (for 5 s and more), not before the
    # 0.5 s header timeout: the timeout cut it, not the client ending
    assert closed_after is not None, "the proxy never closed the slowloris connection"
    assert closed_after > 0.3
    assert len(fb.requests) == 1  # only the normal request
    assert p.in_flight_samples() == [0.0]


BODY_TIMEOUT_S = 30.0
"""`body_timeout_s` of the slow-body tests: a realistic limit, moved past on the proxy's clock."""


@pytest.mark.parametrize("trickle", [False, True])
async def test_slowloris_body_gets_408(fake_backend, proxy, trickle):
    """A body that stops (or trickles a byte at a time, never reaching its declared length) is
    answered 408 once `body_timeout_s` has passed on the proxy's clock since its read began: not
    1 s before, and the proxy serves others meanwhile."""
    fb = await fake_backend(chunks=2)
    clock = ShiftedClock()
    p = await proxy(
        baseline=[fb.url], policy="fixed", body_timeout_s=BODY_TIMEOUT_S, health_checks=False, clock=clock
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(p.url))
    head = _request("/v1/chat/completions", b"", content_length=1000)
    writer.write(head + b'{"messages": [')
    answer = b""
    try:

        async def trickler() -> None:
            for _ in range(200):  # a byte every 20 ms, far from the 1000 declared
                writer.write(b" ")
                await asyncio.sleep(0.02)

        task = asyncio.create_task(trickler()) if trickle else None
        assert await wait_until(lambda: len(p.forwarder.active) == 1, 5)  # its body's read has begun
        await _normal_request(p.base_url)  # served meanwhile
        answered = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        clock.advance(BODY_TIMEOUT_S - 1)
        await asyncio.sleep(3 * POLL_S)  # the deadline's timer (due within POLL_S) has checked since
        assert not answered.done(), "answered before body_timeout_s"
        clock.advance(2)
        head = await asyncio.wait_for(answered, 5.0)
        status, headers, _ = _split_response(head)
        answer = head + await reader.readexactly(int(headers["content-length"]))
        if task is not None:
            task.cancel()
    finally:
        writer.close()
    status, headers, body = _split_response(answer)
    assert status == 408
    assert headers["content-type"].startswith("application/json")
    assert_openai_error(json.loads(body), "request_timeout")
    assert len(fb.requests) == 1  # only the normal request reached the backend
    assert p.in_flight_samples() == [0.0]
    assert p.sample("specroute_rejected_requests_total", code="408") == 1.0


async def test_a_body_that_trickles_in_within_body_timeout_s_is_served(fake_backend, proxy):
    """The body timeout bounds the whole read, not a pause: a body sent in three pieces over 29 s
    of the proxy's clock (of 30) is read to its end and forwarded."""
    fb = await fake_backend(chunks=2)
    clock = ShiftedClock()
    p = await proxy(
        baseline=[fb.url], policy="fixed", body_timeout_s=BODY_TIMEOUT_S, health_checks=False, clock=clock
    )
    body = json.dumps(BODY).encode()
    cut = len(body) // 3
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(p.url))
    try:
        writer.write(_request("/v1/chat/completions", b"", content_length=len(body)) + body[:cut])
        assert await wait_until(lambda: len(p.forwarder.active) == 1, 5)  # its body's read has begun
        for piece, advance in ((body[cut : 2 * cut], 15.0), (body[2 * cut :], BODY_TIMEOUT_S - 1 - 15.0)):
            clock.advance(advance)
            await asyncio.sleep(3 * POLL_S)  # the deadline's timer has checked the moved clock
            writer.write(piece)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    finally:
        writer.close()
    status, _, _ = _split_response(head)
    assert status == 200
    assert len(fb.requests) == 1 and fb.requests[0]["messages"] == BODY["messages"]
    assert p.sample("specroute_rejected_requests_total", code="408") is None


def _soft_limit(soft: int) -> Callable[[], None]:
    """A preexec_fn that sets the child's soft open-files limit to `soft` before exec."""

    def lower() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return lower


def _soft_open_files(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no 'Max open files' line")


async def test_2000_idle_connections_are_closed_and_others_are_served(fake_backend, spawn_serve):
    """`specroute serve` as a subprocess, started with a soft limit of 1,024 open files (which it
    raises at start-up): 2,000 sockets that never send a byte do not stop a normal client, and
    are all closed after header_timeout_s."""
    n = 2000
    raise_open_files_limit(n + 500)
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < n + 500:
        pytest.skip("the hard open-files limit is too low for 2,000 connections")
    fb = await fake_backend(chunks=2)
    sp = await spawn_serve(
        "--baseline", fb.url, "--policy", "fixed", "--header-timeout-s", "3",
        stderr=asyncio.subprocess.DEVNULL, preexec_fn=_soft_limit(1024),
    )  # fmt: skip
    url = sp.url
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        assert _soft_open_files(sp.proc.pid) >= n + 500  # serve raised its own soft limit
        port = _port(url)
        for start in range(0, n, 100):  # batches: the listen backlog is finite
            conns += await asyncio.gather(
                *(asyncio.open_connection("127.0.0.1", port) for _ in range(start, min(n, start + 100)))
            )
        await _normal_request(url + "/v1")  # all 2,000 are still open here (unless opening was slow)
        # the server closes every idle connection (its header timeout); the wait only guards a hang
        results = await asyncio.wait_for(
            asyncio.gather(*(r.read() for r, _ in conns), return_exceptions=True), 60.0
        )
        assert all(res == b"" or isinstance(res, ConnectionResetError) for res in results)
        await _normal_request(url + "/v1")
        sp.signal(signal.SIGTERM)
        assert await sp.wait(30) == 0
    finally:
        for _, w in conns:
            w.close()


async def test_content_encoding_is_decoded_once_or_rejected(fake_backend, proxy, caplog):
    fb = await fake_backend(chunks=2)
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False)
    payload = json.dumps({**BODY, "stream": False}).encode()
    async with aiohttp.ClientSession() as s:
        gz = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        async with s.post(p.url + "/v1/chat/completions", data=gzip.compress(payload), headers=gz) as r:
            assert r.status == 200, await r.text()
        # the backend got the decoded JSON, without a Content-Encoding that no longer applies
        assert fb.requests[-1]["messages"] == CHAT
        assert "Content-Encoding" not in fb.request_headers[-1]
        async with s.post(p.url + "/v1/chat/completions", data=payload, headers=gz) as r:
            assert r.status == 400
            assert_openai_error(await r.json(), "invalid_request")
    assert len(fb.requests) == 1
    assert "Traceback" not in caplog.text
    await _normal_request(p.base_url)
    assert p.in_flight_samples() == [0.0]


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


async def test_every_encoding_a_client_sends_is_decoded_in_steps_or_refused_clearly(fake_backend, proxy):
    """specroute decodes request bodies itself (aiohttp's decoding is off): gzip (also as
    `x-gzip`, and as several members back to back), zlib-wrapped and raw deflate reach the
    backend as the JSON they hold; a truncated or corrupt body, data after a deflate stream, too
    many gzip members and an encoding specroute does not decode are a 400 naming the problem, the
    backend never asked. A large gzip body arrives whole (decoded over many steps)."""
    fb = await fake_backend(chunks=2)
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False)
    payload = json.dumps({**BODY, "stream": False}).encode()
    half = len(payload) // 2
    good = {
        "gzip": gzip.compress(payload),
        "x-gzip": gzip.compress(payload),
        "GZip ": gzip.compress(payload[:half]) + gzip.compress(payload[half:]),
        "deflate": zlib.compress(payload),
        "identity": payload,
    }
    text = base64.b64encode(random.Random(7).randbytes(3 << 20)).decode()  # inflates ~1.3x, not 100x
    long = {**BODY, "stream": False, "messages": [{"role": "user", "content": text}]}
    bad = {
        ("gzip", gzip.compress(payload)[:-12]): "truncated gzip",
        ("gzip", b"\x1f\x8b" + bytes(30)): "not valid gzip",
        ("deflate", zlib.compress(payload) + b"more"): "after the deflate",
        ("gzip", b"".join(gzip.compress(b" ") for _ in range(80)) + gzip.compress(payload)): "gzip members",
        ("br", payload): "unsupported Content-Encoding 'br'",
    }
    async with aiohttp.ClientSession() as s:

        async def post(encoding: str, data: bytes) -> tuple[int, Any]:
            headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
            async with s.post(p.url + "/v1/chat/completions", data=data, headers=headers) as r:
                return r.status, await r.json()

        for encoding, data in [*good.items(), ("deflate", _raw_deflate(payload))]:
            status, answer = await post(encoding, data)
            assert status == 200, (encoding, answer)
            assert fb.requests[-1]["messages"] == CHAT
        assert (await post("gzip", gzip.compress(json.dumps(long).encode(), 9)))[0] == 200
        assert fb.requests[-1]["messages"] == long["messages"]
        served = len(fb.requests)
        for (encoding, data), needle in bad.items():
            status, answer = await post(encoding, data)
            assert status == 400, (encoding, needle, answer)
            assert needle in answer["error"]["message"], answer
    assert len(fb.requests) == served
    await _normal_request(p.base_url)
    assert p.in_flight_samples() == [0.0]


async def test_costly_bodies_are_read_a_few_at_a_time_and_small_ones_never_wait(fake_backend, proxy):
    """`body_read_concurrency`: a chunked body (no declared size) being sent slowly holds the
    one turn; another chunked body gets 503 `bodies_busy` with Retry-After once
    `admission_wait_s` is over; a small body with a Content-Length is served meanwhile; when the
    slow one is complete it is served too."""
    fb = await fake_backend(chunks=2)
    clock = ShiftedClock()  # admission_wait_s passes on it (the slow body's limit is out of reach)
    p = await proxy(
        baseline=[fb.url], policy="fixed", health_checks=False, body_read_concurrency=1, admission_wait_s=10,
        body_timeout_s=3600, clock=clock,
    )  # fmt: skip
    payload = json.dumps({**BODY, "stream": False}).encode()
    go = asyncio.Event()

    async def slowly() -> Any:
        yield payload[:10]
        await go.wait()
        yield payload[10:]

    async def chunked(s: aiohttp.ClientSession, data: Any) -> tuple[int, Any, str | None]:
        headers = {"Content-Type": "application/json"}
        async with s.post(p.url + "/v1/chat/completions", data=data, headers=headers) as r:
            return r.status, await r.json(), r.headers.get("Retry-After")

    async def once(data: bytes) -> Any:
        yield data

    async with aiohttp.ClientSession() as s:
        slow = asyncio.ensure_future(chunked(s, slowly()))
        assert await wait_until(lambda: p.forwarder.body_gate.full, 10.0)
        status, answer, retry = await asyncio.wait_for(clock.ticking(chunked(s, once(payload)), 11), 5)
        assert (status, answer["error"]["code"], retry) == (503, "bodies_busy", "1")
        async with s.post(p.url + "/v1/chat/completions", json={**BODY, "stream": False}) as r:
            assert r.status == 200  # a Content-Length under 1 MiB: no turn needed
        go.set()
        assert (await slow)[0] == 200
    assert len(fb.requests) == 2


async def test_a_large_body_waits_for_room_in_the_memory_budget_instead_of_being_read_for_nothing(
    fake_backend, proxy
):
    """A body declared over 1 MiB that the memory budget cannot hold now waits for room, reading
    nothing, instead of a 503 at once (after which the client's whole body was read out and
    dropped): three 1.5 MiB bodies being sent slowly hold the budget (5 copies each: 22.5 of 24
    MiB); a fourth waits (`specroute_memory_budget_waiting` 1, nothing of it reaches the backend)
    and is served once one of the three is done. One that waits past `admission_wait_s` (on the
    proxy's clock) gets 503 `memory_budget_exceeded` with Retry-After, counted as a refusal; when
    the slow senders give up, the budget is empty again."""
    clock = ShiftedClock()
    fb = await fake_backend(chunks=2)
    p = await proxy(
        baseline=[fb.url], policy="fixed", health_checks=False, memory_budget_bytes=24 << 20,
        admission_wait_s=60.0, body_timeout_s=3600.0, clock=clock,
    )  # fmt: skip
    prompt = [{"role": "user", "content": "x" * (3 << 19)}]
    payload = json.dumps({**BODY, "stream": False, "messages": prompt}).encode()
    budget = p.forwarder.budget

    async def slow_sender() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        held = budget.used
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(p.url))
        writer.write(_request("/v1/chat/completions", payload)[: 10 - len(payload)])  # headers + 10 bytes
        await writer.drain()
        assert await wait_until(lambda: budget.used > held, 10.0)
        return reader, writer

    async def one_waiting() -> bool:
        return (await metric_samples(p.url, "specroute_memory_budget_waiting"))[()] == 1.0

    async def post(s: aiohttp.ClientSession) -> tuple[int, Any, str | None]:
        headers = {"Content-Type": "application/json"}
        async with s.post(p.url + "/v1/chat/completions", data=payload, headers=headers) as r:
            return r.status, await r.json(), r.headers.get("Retry-After")

    slow = [await slow_sender() for _ in range(3)]
    async with aiohttp.ClientSession() as s:
        fourth = asyncio.ensure_future(post(s))
        assert await wait_until(one_waiting, 10.0)
        assert fb.requests == [] and not fourth.done()
        reader, writer = slow.pop(0)
        writer.write(payload[10:])
        answer = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        status, _, _ = await fourth
        assert status == 200
        assert len(fb.requests) == 2

        slow.append(await slow_sender())  # the budget is full again
        status, answer, retry = await clock.ticking(post(s), 61.0)
        assert (status, answer["error"]["code"], retry) == (503, "memory_budget_exceeded", "1")
        assert (await metric_samples(p.url, "specroute_memory_budget_refusals_total"))[()] == 1.0
    for _, writer in slow:
        writer.close()
    assert await wait_until(lambda: budget.used == 0, 10.0)
    assert len(fb.requests) == 2


async def test_client_that_stops_reading_releases_its_slot(fake_backend, proxy):
    """A client that sends a streaming request and then never reads: once the socket buffers are
    full the proxy cannot deliver anything for client_write_timeout_s, so it gives up the stream,
    closes the upstream request (the backend sees the abort) and releases the slot; others are
    served. (test_hostile_clients.py checks that its connection is closed too.)"""
    fb = await fake_backend(chunks=400_000)  # ~50 MB of events: far more than the socket buffers hold
    clock = ShiftedClock()  # client_write_timeout_s passes on it once the proxy's write blocks
    p = await proxy(
        baseline=[fb.url], policy="fixed", client_write_timeout_s=30, health_checks=False, clock=clock
    )
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", _port(p.url)))
    try:
        body = json.dumps({**BODY, "max_tokens": 400_000}).encode()
        await loop.sock_sendall(sock, _request("/v1/chat/completions", body))
        assert await wait_until(lambda: fb.active == 1, 5)
        fb.chunks = 8  # later requests get short answers
        await _normal_request(p.base_url)  # served while the stuck reader holds its stream
        assert await wait_until(lambda: p.sample("specroute_client_writes_blocked") == 1.0, 10)
        clock.advance(31)
        assert await wait_until(lambda: p.tracker.total_in_flight == 0, 5), p.in_flight_samples()
        assert await wait_until(lambda: fb.aborted == 1 and fb.active == 0, 5)
    finally:
        sock.close()
    assert fb.completed == 1  # only the normal request ran to its end
    assert p.in_flight_samples() == [0.0]


async def test_gzip_bomb_is_refused_by_its_decoded_size(fake_backend, proxy):
    """The body limit counts decoded bytes: 100 kB of gzip that inflate to 50 MB get a 413 at
    once, without the proxy inflating the whole thing."""
    fb = await fake_backend(chunks=2)
    p = await proxy(baseline=[fb.url], policy="fixed", body_limit_bytes=64 * 1024, health_checks=False)
    bomb = gzip.compress(b'{"messages": [], "x": "' + b"a" * 50_000_000 + b'"}', 9)
    assert len(bomb) < 100_000
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(p.url + "/v1/chat/completions", data=bomb, headers=headers) as r,
    ):
        body = await r.json()
    assert r.status == 413
    assert_openai_error(body, "payload_too_large")
    assert fb.requests == []
    await _normal_request(p.base_url)
    assert p.in_flight_samples() == [0.0]
