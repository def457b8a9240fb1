"""Fuzz the request parser through the real app: hypothesis throws random JSON (and non-JSON)
bodies and random headers at /v1/chat/completions and /v1/completions. Whatever arrives, the
client never gets a 5xx (the backend here always answers 200), never a traceback, and every 4xx
from specroute's handlers is OpenAI-shaped; afterwards nothing is left in flight.

The proxy and a tolerant backend run on their own event loop in a background thread (hypothesis
drives a plain synchronous test); requests go out through `http.client`, one connection each."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from controller.proxy.app import TRACKER, create_app, make_runner
from controller.proxy.config import Settings
from policies.registry import PolicyContext, default_registry


async def _tolerant_backend(request: web.Request) -> web.StreamResponse:
    """Answers 200 to anything: a stream when the body asks for one, else a JSON completion."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("stream") is True:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    return web.json_response({"object": "chat.completion", "choices": [], "usage": usage})


@dataclass
class Served:
    port: int
    loop: asyncio.AbstractEventLoop
    app: web.Application

    def in_flight(self) -> int:
        async def read() -> int:
            return self.app[TRACKER].total_in_flight

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runners: list[web.AppRunner] = []

    async def start() -> tuple[int, web.Application]:
        urls = []
        for _ in range(2):
            backend = web.Application(client_max_size=1 << 22)
            backend.router.add_route("*", "/{tail:.*}", _tolerant_backend)
            brunner = web.AppRunner(backend, access_log=None)
            await brunner.setup()
            await web.TCPSite(brunner, "127.0.0.1", 0).start()
            runners.append(brunner)
            urls.append(f"http://127.0.0.1:{brunner.addresses[0][1]}")
        s = Settings.model_validate(
            {
                "baseline": urls[:1],
                "eagle": urls[1:],
                "policy": "threshold",
                "body_limit_bytes": 64 * 1024,
                "health_check_interval_s": 3600,
            }
        )
        registry = default_registry(entry_points=False)
        policy = registry.create(s.policy, s.policy_params, PolicyContext(seed=0))
        app = create_app(s, policy, registry=registry, metrics_registry=CollectorRegistry())
        runner = make_runner(app, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.insert(0, runner)
        return runner.addresses[0][1], app

    port, app = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield Served(port, loop, app)

    async def stop() -> None:
        for r in runners:
            await r.cleanup()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


# --- strategies ----------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5), st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=25,
)
KEYS = ["model", "messages", "prompt", "stream", "max_tokens", "max_completion_tokens", "stream_options", "n"]
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"])}, optional={"content": json_values}
    ),
    max_size=4,
)
request_dicts = st.tuples(
    st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=12), json_values, max_size=8),
    st.fixed_dictionaries(
        {},
        optional={
            "messages": messages,
            "prompt": st.text(max_size=50) | st.lists(st.integers(0, 1000), max_size=8),
            "stream": st.booleans(),
        },
    ),
).map(lambda t: {**t[0], **t[1]})


valid_requests = st.fixed_dictionaries(
    {
        "model": st.text(max_size=10),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=30)}), max_size=3
        ),
    },
    optional={
        "stream": st.booleans(),
        "max_tokens": st.none() | st.integers(0, 10**6),
        "stream_options": json_values,
        "prompt": json_values,
        "temperature": json_values,
        "n": json_values,
    },
)


def _encode(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN/Infinity are written as Python's json reads them


bodies = st.one_of(
    valid_requests.map(_encode),
    request_dicts.map(_encode),
    json_values.map(_encode),
    st.binary(max_size=300),
    request_dicts.map(_encode).flatmap(lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda i: b[:i])),
)
HEADER_NAMES = [
    "x-specroute-mode",
    "x-specroute-hint",
    "authorization",
    "content-type",
    "accept",
    "accept-encoding",
    "content-encoding",
    "x-request-id",
    "user-agent",
]
header_values = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=60
)
header_values = header_values | st.sampled_from(["baseline", "eagle", " EAGLE ", "code", "gzip", "br"])
headers = st.dictionaries(st.sampled_from(HEADER_NAMES), header_values, max_size=5)
paths = st.sampled_from(["/v1/chat/completions", "/v1/completions"])


def _post(port: int, path: str, body: bytes, hdrs: dict[str, str]) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("POST", path, skip_accept_encoding="accept-encoding" in hdrs)
        for k, v in hdrs.items():
            conn.putheader(k, v.strip())
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=paths, body=bodies, hdrs=headers)
def test_random_bodies_and_headers_never_get_a_5xx_or_a_traceback(served, path, body, hdrs):
    status, ctype, answer = _post(served.port, path, body, hdrs)
    assert status < 500, (status, answer[:300])
    assert b"Traceback" not in answer and b'File "' not in answer
    if status >= 400 and ctype.startswith("text/plain"):
        # refused by aiohttp's HTTP parser before any handler ran (e.g. a Content-Encoding it
        # cannot decode): a short plain-text 400, as for an oversized header
        assert status == 400 and len(answer) < 512, (ctype, answer[:300])
    elif status >= 400:
        assert ctype.startswith("application/json"), (status, ctype, answer[:300])
        err = json.loads(answer)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"


def test_nothing_is_left_in_flight(served):
    """Runs after the fuzz test (same module fixture): every request released its slot."""
    for _ in range(3):
        _post(served.port, "/v1/chat/completions", b'{"messages": []}', {})
    assert served.in_flight() == 0
