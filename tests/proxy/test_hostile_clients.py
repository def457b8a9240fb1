"""Hostile clients, second round (issue 16): bodies that are cheap to send and costly to parse,
header bytes that cannot be forwarded unchanged, clients that read slowly or not at all, and the
admin endpoint's body and plugin loading. Each gets a clear error or bounded treatment, and what
a slow client costs is never blamed on the backend."""

from __future__ import annotations

import asyncio
import json
import socket
import sys

import aiohttp
import openai
import pytest
from fakes import POLL_S, ShiftedClock
from helpers import BODY, assert_openai_error, port_of, raw_exchange, raw_post, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st


async def _health(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
        await r.read()
        return r.status


# --- bodies -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostile", "needle"),
    [
        (b'{"messages": [], "x": [' + b"[]," * 1_000_000 + b"[]]}", "JSON objects and arrays"),
        (b'{"messages": [], "x": [' + b"{}," * 1_000_000 + b"{}]}", "JSON objects and arrays"),
        (b'{"messages": [], "x": [' + b"0," * 1_000_000 + b"0]}", "JSON values"),
        (b'{"messages": [], "x": {' + b'"":0,' * 500_000 + b'"":0}}', "JSON values"),
    ],
    ids=["lists", "objects", "numbers", "keys"],
)
async def test_a_body_of_many_tiny_values_gets_413_before_it_is_parsed(fake_backend, proxy, hostile, needle):
    """A few MB of tiny containers used to be parsed whole (~0.8 GB per 31 MB, on the event loop);
    now the structure is counted as it arrives and the body refused past the budget, while
    /health keeps answering."""
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False)

    async def post() -> tuple[int, dict]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                p.url + "/v1/chat/completions", data=hostile, headers={"Content-Type": "application/json"}
            ) as r,
        ):
            return r.status, await r.json()

    posts = [asyncio.create_task(post()) for _ in range(3)]
    health = []  # /health answered while the bodies arrived (how fast: benchmarks/hostile_bodies.py)
    while not all(t.done() for t in posts):
        health.append(await _health(p.url))
        await asyncio.sleep(0.01)
    for status, body in await asyncio.gather(*posts):
        assert status == 413
        assert_openai_error(body, "payload_too_large")
        assert needle in body["error"]["message"]
    assert fb.requests == []
    assert health and set(health) == {200}
    assert p.sample("specroute_rejected_requests_total", code="413") == 3.0


async def test_a_large_prompt_full_of_punctuation_is_served(fake_backend, proxy):
    """The budget counts structure outside strings: a prompt with 900k commas, colons and
    brackets in its text is within a budget of 500k values. (Under the fake backend's 1 MB.)"""
    fb = await fake_backend(chunks=2)
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False)
    code = "[{,:}]" * 130_000
    c = openai.AsyncOpenAI(base_url=p.base_url, api_key="k", max_retries=0)
    out = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": code}])
    await c.close()
    assert out.choices[0].message.content == "tok0 tok1 "
    assert fb.requests[-1]["messages"][0]["content"] == code


async def test_a_declared_length_over_the_limit_is_refused_unread(fake_backend, proxy):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False, body_limit_bytes=1024)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000000\r\n\r\n"
    )
    # Read the answer, not until the close: aiohttp lingers up to 10 s for the body it refused.
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(p.url))
    try:
        writer.write(head + b"{")
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 15)
        length = int(
            next(
                v
                for k, _, v in (h.partition(b": ") for h in answer.split(b"\r\n"))
                if k.lower() == b"content-length"
            )
        )
        body = await asyncio.wait_for(reader.readexactly(length), 15)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 413")
    assert_openai_error(json.loads(body), "payload_too_large")


# --- headers ------------------------------------------------------------------------------


async def test_a_header_that_is_not_utf8_is_refused_not_altered(fake_backend, proxy):
    """aiohttp's client re-encodes header values and silently drops bytes that are not UTF-8:
    the backend would have checked an Authorization the client never sent."""
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False)
    body = json.dumps({**BODY, "stream": False}).encode()
    for header in (b"Authorization: Bearer k\xff\xfeey\r\n", b"X-Note: caf\xe9\r\n"):
        answer = await raw_exchange(port_of(p.url), raw_post("/v1/chat/completions", body, header))
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
        error = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert_openai_error(error, "invalid_request")
        assert "not valid UTF-8" in error["error"]["message"]
    assert fb.requests == []
    ok = await raw_exchange(
        port_of(p.url), raw_post("/v1/chat/completions", body, "X-Note: café\r\n".encode())
    )
    assert ok.startswith(b"HTTP/1.1 200")
    assert fb.request_headers[-1]["X-Note"] == "café"  # valid UTF-8 goes through unchanged


# --- slow and stuck readers ---------------------------------------------------------------


def _slow_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    return sock


async def test_a_slow_reader_is_not_blamed_on_the_backend(fake_backend, proxy, caplog):
    """The backend sends ~6 MB at once; the client reads nothing for 6 s, then everything. Once the
    socket buffers are full the proxy's write to the client blocks for seconds, far longer than
    idle_timeout_s: that time is not backend silence, so the stream completes and nothing is
    logged against the backend (it used to be cut with "sent nothing for 3 s"). The 6 s pass on
    the proxy's clock (`ShiftedClock`), not in the test's real time."""
    fb = await fake_backend(chunks=24_000)  # ~250 B per event
    clock = ShiftedClock()
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False, idle_timeout_s=3.0, clock=clock)
    sock = _slow_socket()
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port_of(p.url)))
    data = b""
    try:
        body = json.dumps({**BODY, "max_tokens": 24_000}).encode()
        await loop.sock_sendall(sock, raw_post("/v1/chat/completions", body))
        assert await wait_until(lambda: fb.active == 1, 5)
        # the socket buffers fill: the proxy's write blocks (the gauge reads the relay's watchdog)
        assert await wait_until(lambda: p.sample("specroute_client_writes_blocked") == 1.0, 10)
        clock.advance(6.0)
        await asyncio.sleep(2 * POLL_S)  # the watchdog's timer (due within POLL_S) has checked since
        async with asyncio.timeout(60):
            while not data.endswith(b"0\r\n\r\n"):
                chunk = await loop.sock_recv(sock, 1 << 20)
                if not chunk:
                    break
                data += chunk
    finally:
        sock.close()
    assert b"sent nothing" not in data and b"stream_broken" not in data
    assert data.count(b'"content":"tok') == 24_000
    await p.wait_idle()
    assert p.records[-1].outcome.status == "ok"
    assert "sent nothing" not in caplog.text
    assert p.sample("specroute_client_writes_blocked") == 0.0


async def test_a_client_that_stops_reading_is_given_up_and_its_connection_closed(fake_backend, proxy):
    """After client_write_timeout_s (30 s, on the proxy's clock) of a blocked write the stream is
    given up, not before: the upstream request is closed (the backend aborts) and the client's
    connection is aborted, so neither its socket nor its unsent buffer outlives the request."""
    fb = await fake_backend(chunks=400_000)  # far more than the socket buffers hold
    clock = ShiftedClock()
    p = await proxy(
        baseline=[fb.url], policy="fixed", health_checks=False, client_write_timeout_s=30, idle_timeout_s=60,
        clock=clock,
    )  # fmt: skip
    sock = _slow_socket()
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port_of(p.url)))
    try:
        body = json.dumps({**BODY, "max_tokens": 400_000}).encode()
        await loop.sock_sendall(sock, raw_post("/v1/chat/completions", body))
        assert await wait_until(lambda: fb.active == 1, 5)
        assert await wait_until(lambda: p.sample("specroute_client_writes_blocked") == 1.0, 10)
        clock.advance(29)
        await asyncio.sleep(2 * POLL_S)  # the watchdog's timer (due within POLL_S) has checked since
        assert p.tracker.total_in_flight == 1 and fb.aborted == 0  # not given up before the 30 s
        clock.advance(2)
        assert await wait_until(lambda: p.tracker.total_in_flight == 0, 5)
        assert await wait_until(lambda: fb.aborted == 1 and fb.active == 0, 5)
        # the proxy dropped the connection: reading drains what was buffered, then it ends
        async with asyncio.timeout(10):
            while True:
                try:
                    if not await loop.sock_recv(sock, 1 << 20):
                        break
                except ConnectionResetError:
                    break
    finally:
        sock.close()
    assert p.sample("specroute_client_write_timeouts_total") == 1.0
    assert p.records[-1].outcome.status == "client_closed"


# --- admin --------------------------------------------------------------------------------

TOKEN = "adm-3e9b0c"


async def _admin(url: str, data: bytes) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s, s.post(url + "/admin/policy", data=data, headers=headers) as r:
        return r.status, await r.json()


async def test_admin_body_is_parsed_within_the_same_limits(fake_backend, proxy):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", admin_token=TOKEN, health_checks=False)
    status, body = await _admin(p.url, b"[" * 50_000 + b"]" * 50_000)
    assert status == 400 and "nested too deeply" in body["error"]["message"]  # was 500 + traceback
    status, body = await _admin(p.url, b"[" + b"[]," * 200_000 + b"[]]")
    assert status == 413
    assert_openai_error(body, "payload_too_large")


async def test_admin_loads_module_classes_only_from_the_allow_list(fake_backend, proxy, monkeypatch):
    fb = await fake_backend()
    probe = "plugin_import_probe"
    # whatever ran before in this process (a rerun, another test): start with the probe unimported
    monkeypatch.delitem(sys.modules, probe, raising=False)
    p = await proxy(baseline=[fb.url], policy="fixed", admin_token=TOKEN, health_checks=False)
    status, body = await _admin(p.url, json.dumps({"name": f"{probe}:ProbePolicy"}).encode())
    assert status == 400 and "admin_policy_modules" in body["error"]["message"]
    assert probe not in sys.modules  # refused before anything was imported
    status, body = await _admin(p.url, json.dumps({"name": "threshold"}).encode())
    assert status == 200  # built-ins are always allowed
    allowed = await proxy(
        baseline=[fb.url],
        policy="fixed",
        admin_token=TOKEN,
        health_checks=False,
        admin_policy_modules=[probe],
    )
    status, body = await _admin(allowed.url, json.dumps({"name": f"{probe}:ProbePolicy"}).encode())
    assert status == 200, body
    assert probe in sys.modules


# --- large bodies parsed in short steps (issue 25, row L) ---------------------------------

_TEXT = st.text(alphabet=st.sampled_from([*'ab"\\\n\t/\u00e9\U0001f600\ud800\x01']), max_size=200)


@settings(max_examples=300, deadline=None)
@given(st.lists(_TEXT, max_size=4), st.integers(min_value=1, max_value=40))
def test_the_windowed_parser_gives_what_json_loads_gives(texts: list[str], window: int) -> None:
    """`load_large_json` decodes long strings window by window; on any text (escapes, surrogate
    pairs and lone surrogates, control characters, cut anywhere) its result or error is
    `json.loads`'s. Windows of 1-40 characters so every cut is tried."""
    from controller.proxy import limits
    from controller.proxy.errors import BadRequest

    raws = [
        json.dumps({"messages": texts, "n": 1}).encode(),
        json.dumps(texts, ensure_ascii=False).encode("utf-8", "surrogatepass"),
    ]
    raws += [r.replace(b"\\\\", b"\\") for r in raws]  # invalid escapes too
    old = limits.WINDOW
    limits.WINDOW = window
    try:
        for raw in raws:
            try:
                expected: object = limits.load_json(raw)
            except BadRequest as e:
                expected = ("error", e.message)
            try:
                got: object = asyncio.run(limits.load_large_json(raw))
            except BadRequest as e:
                got = ("error", e.message)
            assert got == expected, raw[:200]
    finally:
        limits.WINDOW = old
