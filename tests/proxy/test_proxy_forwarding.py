"""Through the proxy, clients get exactly what the backend sends: the official openai client
(sync and async, streaming and not, chat and completions), raw SSE bytes, headers, pass-through
of unknown fields, /v1/models, per-pool model rewrite and API key."""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import aiohttp
import openai
import pytest
from helpers import FRANCE, post_bytes, run_command

CHAT = FRANCE


async def test_async_client_streaming_chat_identical_to_direct(fake_backend, proxy):
    fb = await fake_backend(chunks=6)
    p = await proxy(baseline=[fb.url], policy="fixed", policy_params={"pool": "baseline"})

    async def collect(base_url: str) -> list[dict[str, Any]]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="k")
        stream = await client.chat.completions.create(
            model="m", messages=CHAT, stream=True, stream_options={"include_usage": True}
        )
        out = [chunk.model_dump() async for chunk in stream]
        await client.close()
        return out

    direct = await collect(fb.url + "/v1")
    proxied = await collect(p.base_url)
    assert proxied == direct
    assert proxied[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in proxied if c["choices"]) == (
        "tok0 tok1 tok2 tok3 tok4 tok5 "
    )
    assert proxied[-1]["choices"] == [] and proxied[-1]["usage"]["completion_tokens"] == 6


async def test_raw_sse_bytes_pass_through_unchanged(fake_backend, proxy):
    fb = await fake_backend(chunks=5)
    p = await proxy(eagle=[fb.url], policy="fixed", policy_params={"pool": "eagle"})
    for path, body in [
        ("/v1/chat/completions", {"model": "m", "messages": CHAT}),
        ("/v1/completions", {"model": "m", "prompt": "The capital of France is"}),
    ]:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        direct = await post_bytes(fb.url, path, body)
        proxied = await post_bytes(p.url, path, body)
        assert proxied == direct
        assert proxied.endswith(
            b'"completion_tokens":5,"prompt_tokens_details":null,'
            b'"reasoning_tokens":0,"completion_tokens_details":null}}\n\ndata: [DONE]\n\n'
        )
    # the outcome saw the TTFT and the usage chunk's completion tokens
    assert p.records[-1].outcome.completion_tokens == 5
    assert p.records[-1].outcome.ttft_s is not None
    assert p.records[-1].outcome.status == "ok"


async def test_streams_without_include_usage_still_count_tokens(fake_backend, proxy):
    """Most clients do not set `stream_options.include_usage`; specroute asks the backend for the
    usage chunk anyway (token counts for the outcome, the policy, metrics and the decision log)
    and does not relay it: the client gets exactly the bytes the backend would have sent it."""
    fb = await fake_backend(chunks=5)
    p = await proxy(eagle=[fb.url], policy="fixed", policy_params={"pool": "eagle"})
    for path, body in [
        ("/v1/chat/completions", {"model": "m", "messages": CHAT, "stream": True, "ignore_eos": True}),
        ("/v1/completions", {"model": "m", "prompt": "The capital of France is", "stream": True}),
    ]:
        direct = await post_bytes(fb.url, path, body)
        proxied = await post_bytes(p.url, path, body)
        assert proxied == direct
        assert b'"usage":{' not in proxied and proxied.endswith(b"data: [DONE]\n\n")
        assert fb.requests[-1] == {**body, "stream_options": {"include_usage": True}}
        await p.wait_idle()
        assert p.records[-1].outcome.completion_tokens == 5
        assert p.records[-1].outcome.decode_tok_s is not None
    assert p.sample("specroute_output_tokens_total", pool="eagle") == 10
    # other stream_options are kept; a client that asked for usage still gets it
    for options, relayed in (
        ({"continuous_usage_stats": False}, False),
        ({"include_usage": True}, True),
        (None, False),
    ):
        body = {"model": "m", "messages": CHAT, "stream": True, "stream_options": options}
        proxied = await post_bytes(p.url, "/v1/chat/completions", body)
        assert (b'"usage":{' in proxied) is relayed
        assert fb.requests[-1]["stream_options"] == {**(options or {}), "include_usage": True}
        await p.wait_idle()
        assert p.records[-1].outcome.completion_tokens == 5
    assert p.sample("specroute_output_tokens_total", pool="eagle") == 25


async def test_sync_client_all_shapes_identical_to_direct(fake_backend, proxy):
    fb = await fake_backend(chunks=4)
    p = await proxy(baseline=[fb.url], policy="fixed")

    def run(base_url: str) -> list[Any]:
        with openai.OpenAI(base_url=base_url, api_key="k") as c:
            chat = c.chat.completions.create(model="m", messages=CHAT).model_dump()
            chat_stream = [
                x.model_dump() for x in c.chat.completions.create(model="m", messages=CHAT, stream=True)
            ]
            comp = c.completions.create(model="m", prompt="Paris is").model_dump()
            comp_stream = [
                x.model_dump() for x in c.completions.create(model="m", prompt="Paris is", stream=True)
            ]
            return [chat, chat_stream, comp, comp_stream]

    direct = await asyncio.to_thread(run, fb.url + "/v1")
    proxied = await asyncio.to_thread(run, p.base_url)
    assert proxied == direct
    chat, chat_stream, comp, comp_stream = proxied
    assert chat["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 "
    assert chat["usage"]["completion_tokens"] == 4
    assert comp["choices"][0]["text"] == "tok0 tok1 tok2 tok3 "
    assert len(chat_stream) == 6  # role, 4 content chunks, finish
    assert comp_stream[-1]["choices"][0]["finish_reason"] == "length"
    non_stream = [r for r in p.records if not r.request.stream]
    assert [r.outcome.completion_tokens for r in non_stream] == [4, 4]


async def test_async_client_non_streaming_completions(fake_backend, proxy):
    fb = await fake_backend(chunks=3)
    p = await proxy(eagle=[fb.url], policy="fixed", policy_params={"pool": "eagle"})
    client = openai.AsyncOpenAI(base_url=p.base_url, api_key="k")
    raw = await client.completions.with_raw_response.create(model="m", prompt="x", max_tokens=2)
    comp = raw.parse()
    await client.close()
    assert comp.choices[0].text == "tok0 tok1 "
    assert raw.headers["x-specroute-pool"] == "eagle"
    assert raw.headers["x-specroute-backend"] == fb.url
    assert raw.headers["x-specroute-reason"] == "fixed_eagle"


async def test_headers_name_pool_and_client_override(fake_backend, proxy):
    base = await fake_backend()
    eagle = await fake_backend()
    p = await proxy(
        baseline=[base.url],
        eagle=[eagle.url],
        policy="fixed",
        policy_params={"pool": "eagle"},
        allow_client_override=True,
    )
    client = openai.AsyncOpenAI(base_url=p.base_url, api_key="k")
    r = await client.chat.completions.with_raw_response.create(model="m", messages=CHAT)
    assert (r.headers["x-specroute-pool"], r.headers["x-specroute-reason"]) == ("eagle", "fixed_eagle")
    r = await client.chat.completions.with_raw_response.create(
        model="m", messages=CHAT, extra_headers={"x-specroute-mode": "baseline", "x-specroute-hint": "code"}
    )
    assert (r.headers["x-specroute-pool"], r.headers["x-specroute-reason"]) == ("baseline", "client_override")
    assert r.headers["x-specroute-backend"] == base.url
    assert p.records[-1].request.hint == "code"
    assert p.records[-1].request.forced_pool == "baseline"
    # an unbounded hint is ignored, not an error
    await client.chat.completions.create(model="m", messages=CHAT, extra_headers={"x-specroute-hint": "a b!"})
    assert p.records[-1].request.hint is None
    await client.close()
    # the header names never reach the backend
    assert not any(k.lower().startswith("x-specroute") for k in base.request_headers[-1])
    assert (
        p.sample("specroute_decisions_total", policy="fixed", pool="baseline", reason="client_override")
        == 1.0
    )


async def test_client_override_is_off_by_default(fake_backend, proxy):
    base = await fake_backend()
    eagle = await fake_backend()
    p = await proxy(baseline=[base.url], eagle=[eagle.url], policy="fixed")
    assert p.settings.allow_client_override is False
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            p.url + "/v1/chat/completions",
            json={"model": "m", "messages": CHAT},
            headers={"x-specroute-mode": "eagle"},
        ) as r,
    ):
        assert r.status == 200
        assert r.headers["x-specroute-pool"] == "baseline"


async def test_unknown_fields_pass_through(fake_backend, proxy):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed")
    extra = {"ignore_eos": True, "rid": "my-rid-1", "return_spec_tokens_details": True, "top_k": 5}
    client = openai.AsyncOpenAI(base_url=p.base_url, api_key="client-key")
    out = await client.chat.completions.create(model="my-model", messages=CHAT, extra_body=extra)
    await client.close()
    assert out.id == "my-rid-1"
    sent = fb.requests[-1]
    for k, v in extra.items():
        assert sent[k] == v
    assert sent["model"] == "my-model"
    assert fb.request_headers[-1]["Authorization"] == "Bearer client-key"


async def test_model_rewrite_and_api_key_per_pool(fake_backend, proxy):
    base = await fake_backend()
    eagle = await fake_backend()
    p = await proxy(
        baseline=[base.url],
        eagle=[eagle.url],
        policy="fixed",
        policy_params={"pool": "eagle"},
        eagle_model="served-eagle",
        eagle_api_key="secret-eagle",
        allow_client_override=True,
    )
    client = openai.AsyncOpenAI(base_url=p.base_url, api_key="client-key")
    out = await client.chat.completions.create(model="m", messages=CHAT, extra_body={"ignore_eos": True})
    assert out.model == "served-eagle"
    assert eagle.requests[-1]["model"] == "served-eagle" and eagle.requests[-1]["ignore_eos"] is True
    assert eagle.request_headers[-1]["Authorization"] == "Bearer secret-eagle"
    await client.chat.completions.create(
        model="m", messages=CHAT, extra_headers={"x-specroute-mode": "baseline"}
    )
    await client.close()
    assert base.requests[-1]["model"] == "m"
    assert base.request_headers[-1]["Authorization"] == "Bearer client-key"


async def test_models_health_ready_metrics(fake_backend, proxy):
    fb = await fake_backend(model="served-name")
    p = await proxy(baseline=[fb.url], policy="fixed")
    client = openai.AsyncOpenAI(base_url=p.base_url, api_key="k")
    models = await client.models.list()
    await client.close()
    assert [m.id for m in models.data] == ["served-name"]
    async with aiohttp.ClientSession() as s:
        async with s.get(p.url + "/health") as r:
            assert r.status == 200
        async with s.get(p.url + "/ready") as r:
            assert r.status == 200
        async with s.get(p.url + "/metrics") as r:
            text = await r.text()
    assert r.status == 200
    assert f'specroute_in_flight_requests{{backend="{fb.url}",pool="baseline"}} 0.0' in text
    assert f'specroute_backend_healthy{{backend="{fb.url}",pool="baseline"}} 1.0' in text


async def test_metrics_exposition_passes_promtool(fake_backend, proxy):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed")
    async with aiohttp.ClientSession() as s:
        async with s.post(p.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}) as r:
            await r.read()
        async with s.post(p.url + "/v1/chat/completions", data=b"{") as r:
            await r.read()
        async with s.get(p.url + "/metrics") as r:
            text = await r.read()
    assert b'specroute_requests_total{backend="' in text
    assert b'specroute_decisions_total{policy="fixed",pool="baseline",reason="fixed_baseline"} 1.0' in text
    code, out, err = await run_command(promtool, "check", "metrics", stdin=text.decode())
    assert code == 0, out + err
