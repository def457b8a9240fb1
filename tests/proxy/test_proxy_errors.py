"""Every bad input gets its status and an OpenAI-shaped error body from specroute itself."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from fakes import ShiftedClock, closed_port_url
from helpers import assert_openai_error


@pytest.mark.parametrize(
    ("path", "data", "headers", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json", {}, 400, "invalid_request"),
        ("/v1/chat/completions", b"\xff\xfe", {}, 400, "invalid_request"),
        ("/v1/chat/completions", b"[1, 2]", {}, 400, "invalid_request"),
        ("/v1/chat/completions", b'"text"', {}, 400, "invalid_request"),
        ("/v1/chat/completions", b'{"model": "m"}', {}, 400, "invalid_request"),
        ("/v1/chat/completions", b'{"messages": "hi"}', {}, 400, "invalid_request"),
        ("/v1/chat/completions", b'{"messages": [], "stream": "yes"}', {}, 400, "invalid_request"),
        ("/v1/completions", b'{"model": "m", "messages": []}', {}, 400, "invalid_request"),
        ("/v1/chat/completions", b'{"messages": [{}]}', {"x-specroute-mode": "t"}, 400, "invalid_request"),
        ("/v1/chat/completions", b"x" * 2048, {}, 413, "payload_too_large"),
    ],
)
async def test_bad_requests(fake_backend, proxy, path, data, headers, status, code):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", body_limit_bytes=1024, allow_client_override=True)
    async with (
        aiohttp.ClientSession() as s,
        s.post(p.url + path, data=data, headers={"Content-Type": "application/json", **headers}) as r,
    ):
        body = await r.json()
    assert r.status == status
    assert_openai_error(body, code)
    assert fb.requests == []
    assert p.sample("specroute_rejected_requests_total", code=str(status)) == 1.0
    assert p.tracker.total_in_flight == 0


async def test_unknown_route_and_wrong_method(proxy, fake_backend):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed")
    async with aiohttp.ClientSession() as s:
        async with s.get(p.url + "/v1/nothing") as r:
            assert r.status == 404
            assert_openai_error(await r.json(), "not_found")
        async with s.get(p.url + "/v1/chat/completions") as r:
            assert r.status == 405
            assert r.headers["Allow"] == "POST"
            assert_openai_error(await r.json(), "method_not_allowed")
        async with s.post(p.url + "/admin/policy", json={"name": "fixed"}) as r:
            assert r.status == 404  # admin disabled without a token
            assert_openai_error(await r.json(), "not_found")


async def _raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return int(lines[0].split()[1]), headers, body
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (  # aiohttp answers a bogus Expect itself, before any middleware: 417 in plain text
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: bogus\r\n"
            b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
            417,
            "expectation_failed",
        ),
        (b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, "method_not_allowed"),
        (b"GET /nothing/here HTTP/1.1\r\nHost: x\r\n\r\n", 404, "not_found"),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000\r\n\r\n" + b" " * 5000,
            413,
            "payload_too_large",
        ),
    ],
)
async def test_aiohttp_own_errors_are_openai_shaped(fake_backend, proxy, request_bytes, status, code):
    """Raw HTTP/1.1 (a client library would not send a bogus Expect): status kept, JSON body."""
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", body_limit_bytes=1024)
    port = int(p.url.rsplit(":", 1)[1])
    got, headers, body = await _raw(port, request_bytes)
    assert got == status, body
    assert headers["content-type"].startswith("application/json")
    assert_openai_error(json.loads(body), code)
    assert fb.requests == []


async def test_expect_100_continue_still_works(fake_backend, proxy):
    fb = await fake_backend(chunks=2)
    p = await proxy(baseline=[fb.url], policy="fixed")
    port = int(p.url.rsplit(":", 1)[1])
    payload = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload)
        )
        await writer.drain()
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(payload)
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"content"' in answer


async def test_head_answers_like_get(fake_backend, proxy):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed")
    async with aiohttp.ClientSession() as s, s.head(p.url + "/health") as r:
        assert r.status == 200


# SGLang refuses these (its protocol models, _validate_request and SamplingParams.verify); the
# proxy refuses them before reserving a backend, with the field named in `param`.
SGLANG_REFUSES = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"temperature": -0.5}, "temperature"),
    ("/v1/chat/completions", {"top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": 0}, "top_k"),
    ("/v1/chat/completions", {"min_p": 2}, "min_p"),
    ("/v1/chat/completions", {"frequency_penalty": 3}, "frequency_penalty"),
    ("/v1/chat/completions", {"presence_penalty": -2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"max_tokens": 4, "min_tokens": 8}, "min_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("/generate", {"text": "x", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
]


@pytest.mark.parametrize(("path", "extra", "param"), SGLANG_REFUSES)
async def test_validation_matches_sglang_where_it_is_stricter(fake_backend, proxy, path, extra, param):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False)
    base = (
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        if path.endswith("chat/completions")
        else {}
    )
    async with aiohttp.ClientSession() as s, s.post(p.url + path, json={**base, **extra}) as r:
        body = await r.json()
    assert r.status == 400, body
    assert_openai_error(body, "invalid_request")
    assert body["error"]["param"] == param and param.rsplit(".", 1)[-1] in body["error"]["message"]
    assert fb.requests == [] and p.tracker.total_in_flight == 0


async def test_sglang_accepted_edges_pass(fake_backend, proxy):
    """The edges SGLang accepts are not refused: greedy temperature 0, top_k -1, top_p 1, nulls,
    and /generate's max_new_tokens 0 (a prefill-only request)."""
    fb = await fake_backend(chunks=2)
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False)
    client = openai.AsyncOpenAI(base_url=p.base_url, api_key="k", max_retries=0)
    out = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], temperature=0, top_p=1, max_tokens=1,
        frequency_penalty=-2, presence_penalty=2, n=1, extra_body={"top_k": -1, "min_p": 0, "min_tokens": 1},
    )  # fmt: skip
    await client.close()
    assert out.choices
    async with aiohttp.ClientSession() as s:
        nulls = {"messages": [{"role": "user", "content": "x"}], "temperature": None, "max_tokens": None}
        async with s.post(p.url + "/v1/chat/completions", json=nulls) as r:
            assert r.status == 200, await r.text()
        async with s.post(
            p.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 0}}
        ) as r:
            assert r.status != 400, await r.text()
    assert len(fb.requests) >= 2  # the two OpenAI ones reached the backend


async def test_openai_client_sees_502_503_504(fake_backend, proxy):
    stalled = await fake_backend()
    stalled.mode = "stall"
    dropping = await fake_backend()
    dropping.mode = "drop"
    clock = ShiftedClock()
    cases = [
        (
            dict(baseline=[dropping.url], health_checks=False),
            openai.InternalServerError,
            502,
            "backend_failed",
        ),
        (  # the only backend refuses: none is healthy any more
            dict(baseline=[closed_port_url()], health_checks=False),
            openai.InternalServerError,
            503,
            "no_healthy_backend",
        ),
        (  # one failure ejects (and no panic routing): the next request finds no backend
            dict(  # on the proxy's clock: a minute's timeouts, no waiting (`ShiftedClock.ticking`)
                baseline=[stalled.url],
                first_byte_timeout_s=60,
                request_timeout_s=60,  # a non-streaming request's own total timeout
                health_checks=False,
                outlier_consecutive_failures=1,
                outlier_base_ejection_s=3600,  # a later tick must not end the ejection
                panic_routing=False,
                clock=clock,
            ),
            openai.InternalServerError,
            504,
            "backend_timeout",
        ),
    ]
    for kwargs, exc, status, code in cases:
        p = await proxy(policy="fixed", **kwargs)
        client = openai.AsyncOpenAI(base_url=p.base_url, api_key="k", max_retries=0)
        with pytest.raises(exc) as info:
            call = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
            await clock.ticking(call, 61)
        await client.close()
        assert info.value.status_code == status
        assert_openai_error(info.value.response.json(), code)
        assert p.tracker.total_in_flight == 0
    # now every backend is ejected: 503
    client = openai.AsyncOpenAI(base_url=p.base_url, api_key="k", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    await client.close()
    assert info.value.status_code == 503
    assert_openai_error(info.value.response.json(), "no_healthy_backend")


async def test_backend_errors_reach_the_client_in_openai_shape(fake_backend, proxy):
    fb = await fake_backend()
    fb.mode = "bad_request"
    p = await proxy(baseline=[fb.url], policy="fixed")
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            p.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        ) as r,
    ):
        body = await r.json()
    assert r.status == 400  # the backend's status and text, in OpenAI's shape (issue 22)
    assert body == {
        "error": {
            "message": "fake bad_request",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_request",
        }
    }
    assert r.headers["x-specroute-pool"] == "baseline"
