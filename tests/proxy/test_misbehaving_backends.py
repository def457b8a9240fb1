"""Backends that misbehave on purpose (raw-socket fakes where no HTTP framework would): redirects
are not followed, a 101 is not relayed, compressed answers stay decodable, hop-by-hop headers
stop at the proxy, a close-delimited stream torn mid-event ends with an error event, and what the
proxy buffers of an answer is bounded."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket

import aiohttp
import openai
import pytest
from fakes import RAW_COMPLETION, RawBackend, RawRequest
from helpers import BODY, CHAT, assert_openai_error

CHUNK = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "a"}}]}
EVENT = b"data: " + json.dumps(CHUNK).encode() + b"\n\n"


def _posts(rb: RawBackend) -> list[RawRequest]:
    """The completions a backend received (the proxy's scrapes are GETs)."""
    return [r for r in rb.requests if r.method == "POST"]


def _head(status: str, *headers: str) -> bytes:
    return ("HTTP/1.1 " + status + "\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


@pytest.mark.parametrize(
    "status", ["301 Moved Permanently", "302 Found", "307 Temporary Redirect", "308 Permanent Redirect"]
)
@pytest.mark.parametrize("stream", [True, False])
async def test_redirects_are_not_followed(fake_backend, raw_backend, proxy, status, stream):
    elsewhere = await fake_backend()

    async def redirect(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(_head(status, f"Location: {elsewhere.url}{req.path}", "Content-Length: 0"))

    rb = await raw_backend(redirect)
    p = await proxy(baseline=[rb.url], policy="fixed", health_checks=False)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            p.url + "/v1/chat/completions",
            json={**BODY, "stream": stream},
            headers={"Authorization": "Bearer k"},
        ) as r,
    ):
        body = await r.json()
    assert r.status == 502
    assert_openai_error(body, "backend_failed")
    assert "redirect" in body["error"]["message"] and "not followed" in body["error"]["message"]
    assert elsewhere.requests == []  # neither the prompt nor the client's key went where it pointed
    assert len(_posts(rb)) == 1
    assert p.tracker.total_in_flight == 0


async def test_a_backend_101_is_answered_502_not_relayed(raw_backend, proxy):
    async def upgrade(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(_head("101 Switching Protocols", "Upgrade: websocket", "Connection: Upgrade"))
        await w.drain()
        await asyncio.sleep(3600)  # the "new protocol" never says anything

    rb = await raw_backend(upgrade)
    p = await proxy(baseline=[rb.url], policy="fixed", health_checks=False)
    c = openai.AsyncOpenAI(base_url=p.base_url, api_key="k", max_retries=0, timeout=30)
    for stream in (True, False):
        with pytest.raises(openai.InternalServerError) as info:
            await asyncio.wait_for(c.chat.completions.create(model="m", messages=CHAT, stream=stream), 10)
        assert info.value.status_code == 502
        assert "answered HTTP 101" in info.value.response.json()["error"]["message"]
    await c.close()
    await p.wait_idle()


async def test_upstream_is_asked_for_identity_and_a_compressed_answer_stays_decodable(
    fake_backend, raw_backend, proxy
):
    plain = await fake_backend()
    p = await proxy(baseline=[plain.url], policy="fixed", health_checks=False)
    async with (
        aiohttp.ClientSession() as s,
        s.post(p.url + "/v1/chat/completions", json=BODY, headers={"Accept-Encoding": "gzip, br"}) as r,
    ):
        await r.read()
    assert r.status == 200
    assert plain.request_headers[-1]["Accept-Encoding"] == "identity"

    packed = gzip.compress(json.dumps(RAW_COMPLETION).encode())

    async def gzips_anyway(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(
            _head(
                "200 OK",
                "Content-Type: application/json",
                "Content-Encoding: gzip",
                f"Content-Length: {len(packed)}",
            )
            + packed
        )

    rb = await raw_backend(gzips_anyway)
    p2 = await proxy(baseline=[rb.url], policy="fixed", health_checks=False)
    c = openai.AsyncOpenAI(base_url=p2.base_url, api_key="k", max_retries=0)
    out = await c.chat.completions.create(model="m", messages=CHAT)
    assert out.choices[0].message.content == "hi"  # the client could decode what the backend sent
    await c.close()


async def test_hop_by_hop_headers_named_in_connection_stop_at_the_proxy(raw_backend, proxy):
    body = json.dumps(RAW_COMPLETION).encode()

    async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(
            _head(
                "200 OK",
                "Content-Type: application/json",
                "Connection: keep-alive, X-Backend-Hop",
                "X-Backend-Hop: internal",
                "X-Backend-Kept: 1",
                f"Content-Length: {len(body)}",
            )
            + body
        )

    rb = await raw_backend(answer)
    p = await proxy(baseline=[rb.url], policy="fixed", health_checks=False)
    request = json.dumps({**BODY, "stream": False}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", int(p.url.rsplit(":", 1)[1]))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close, X-Client-Hop\r\nX-Client-Hop: for-the-proxy-only\r\nX-Client-Kept: 1\r\n"
        b"Content-Length: %d\r\n\r\n" % len(request) + request
    )
    answer_bytes = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head = answer_bytes.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 200")
    assert b"x-backend-kept: 1" in head and b"x-backend-hop" not in head
    (req,) = _posts(rb)
    assert req.header("x-client-kept") == b"1"
    assert req.header("x-client-hop") is None


@pytest.mark.parametrize("strip_usage", [False, True])
async def test_close_delimited_stream_torn_mid_event_ends_with_an_error(raw_backend, proxy, strip_usage):
    async def torn(req: RawRequest, w: asyncio.StreamWriter) -> None:
        # no Content-Length, no chunked framing: the body ends when the connection does
        w.write(_head("200 OK", "Content-Type: text/event-stream") + EVENT + EVENT[:30])

    rb = await raw_backend(torn)
    p = await proxy(baseline=[rb.url], policy="fixed", health_checks=False)
    body = BODY if strip_usage else {**BODY, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/chat/completions", json=body) as r:
        raw = await asyncio.wait_for(r.read(), 10)
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "a"
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "stream_broken" and "inside an event" in error["message"]
    await p.wait_idle()
    assert p.records[-1].outcome.status == "error"


async def test_a_first_event_without_end_is_bounded(raw_backend, proxy):
    async def endless_line(req: RawRequest, w: asyncio.StreamWriter) -> None:
        w.write(_head("200 OK", "Content-Type: text/event-stream") + b"data: ")
        for _ in range(64):  # 4 MB, never a blank line
            w.write(b"x" * 65536)
            await w.drain()

    rb = await raw_backend(endless_line)
    p = await proxy(baseline=[rb.url], policy="fixed", health_checks=False, response_limit_bytes=1 << 20)
    async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/chat/completions", json=BODY) as r:
        body = await r.json()
    assert r.status == 502
    assert_openai_error(body, "backend_failed")
    assert f"first event larger than {1 << 20} bytes" in body["error"]["message"]
    assert p.tracker.total_in_flight == 0


@pytest.mark.parametrize("declared", [True, False])
async def test_a_non_streaming_answer_over_the_bound_is_a_502(raw_backend, proxy, declared):
    big = b'{"x": "' + b"y" * (3 << 20) + b'"}'

    async def huge(req: RawRequest, w: asyncio.StreamWriter) -> None:
        length = f"Content-Length: {len(big)}" if declared else "Connection: close"
        w.write(_head("200 OK", "Content-Type: application/json", length))
        for at in range(0, len(big), 65536):
            w.write(big[at : at + 65536])
            await w.drain()

    rb = await raw_backend(huge)
    p = await proxy(baseline=[rb.url], policy="fixed", health_checks=False, response_limit_bytes=1 << 20)
    async with (
        aiohttp.ClientSession() as s,
        s.post(p.url + "/v1/chat/completions", json={**BODY, "stream": False}) as r,
    ):
        body = await r.json()
    assert r.status == 502
    assert_openai_error(body, "backend_failed")
    assert "bytes" in body["error"]["message"]
    assert p.tracker.total_in_flight == 0


def test_raw_backend_speaks_http_as_written():
    """The fake itself: what it writes is what a client reads (guards the tests above)."""

    async def run() -> bytes:
        async def answer(req: RawRequest, w: asyncio.StreamWriter) -> None:
            w.write(_head("200 OK", "Content-Length: 2") + b"ok")

        rb = RawBackend(answer)
        await rb.start()
        try:
            sock = socket.create_connection(("127.0.0.1", int(rb.url.rsplit(":", 1)[1])))
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(sock, b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            data = b""
            while not data.endswith(b"ok"):
                data += await loop.sock_recv(sock, 1024)
            sock.close()
            assert rb.requests[0].body == b"abc" and rb.requests[0].path == "/x"
            return data
        finally:
            await rb.stop()

    assert asyncio.run(run()).startswith(b"HTTP/1.1 200 OK")
