"""Every bad input gets its status and an OpenAI-shaped error body from specroute itself."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from fakes import closed_port_url
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
        ("/v1/chat/completions", b'{"messages": []}', {"x-specroute-mode": "turbo"}, 400, "invalid_request"),
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


async def test_openai_client_sees_502_503_504(fake_backend, proxy):
    stalled = await fake_backend()
    stalled.mode = "stall"
    dropping = await fake_backend()
    dropping.mode = "drop"
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
            dict(
                baseline=[stalled.url],
                first_byte_timeout_s=0.2,
                request_timeout_s=0.2,  # a non-streaming request's own total timeout
                health_checks=False,
                outlier_consecutive_failures=1,
                panic_routing=False,
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
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
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
        s.post(p.url + "/v1/chat/completions", json={"model": "m", "messages": []}) as r,
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
