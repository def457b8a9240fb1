"""`backend_header: false` hides the backends from clients everywhere (issue 25, row N): their
names used to stay in `stream_broken` events, 502/503 bodies and `/ready`. Through the real
`serve`, with backends on raw sockets and the official client: nothing a client can read (bodies,
stream events, headers, `/ready`, `/server_info`) names a backend or its address; only the pool
is shown. The operator's log still names them."""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
import openai
import pytest
from fakes import RawBackend, RawRequest, closed_port_url
from helpers import CHAT, wait_until

from controller.proxy.identity import BackendIdentity

CHUNK = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "a"}}]}
EVENT = b"data: " + json.dumps(CHUNK).encode() + b"\n\n"
NAME = "gpu-rack7-node3"


def _head(status: str, *headers: str) -> bytes:
    return ("HTTP/1.1 " + status + "\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


async def _torn_stream_backend(req: RawRequest, w: asyncio.StreamWriter) -> None:
    """Healthy to probes; a chat stream torn inside its second event; a /server_info with the
    backend's own address and API key in it (SGLang's launch arguments)."""
    if req.path in ("/ready", "/health"):
        w.write(_head("200 OK", "Content-Type: application/json", "Content-Length: 2") + b"{}")
        return
    if req.path == "/server_info":
        body = json.dumps(
            {"host": "10.9.8.7", "port": 30000, "api_key": "sk-backend-key-1", "max_total_num_tokens": 1000}
        ).encode()
        w.write(_head("200 OK", "Content-Type: application/json", f"Content-Length: {len(body)}") + body)
        return
    w.write(_head("200 OK", "Content-Type: text/event-stream") + EVENT + EVENT[:30])


def _no_identity(text: str, *tokens: str) -> None:
    for token in tokens:
        assert token not in text, f"{token!r} shown to a client: {text}"


@pytest.mark.parametrize("named", [True, False])
async def test_backend_header_false_hides_backends_from_clients(spawn_serve, named):
    rb = RawBackend(_torn_stream_backend)
    await rb.start()
    dead = closed_port_url()
    base_entry = f"{NAME}={rb.url}" if named else rb.url
    try:
        sp = await spawn_serve(
            "--baseline", base_entry, "--eagle", f"eagle-x9={dead}" if named else dead,
            "--backend-header", "false", "--allow-client-override", "true", "--policy", "fixed",
            "--health-check-interval-s", "0.2",
        )  # fmt: skip
        assert sp.proc.stderr is not None
        stderr = asyncio.ensure_future(sp.proc.stderr.read())
        tokens = (NAME, "eagle-x9", rb.url, dead, rb.url.rsplit(":", 1)[1], dead.rsplit(":", 1)[1])
        client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="k", max_retries=0)
        # 1. a stream torn after its first byte: the error event names no backend
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=CHAT, stream=True)
        _no_identity(json.dumps(dict(raw.headers)), *tokens)
        assert raw.headers["x-specroute-pool"] == "baseline" and "x-specroute-backend" not in raw.headers
        with pytest.raises(openai.APIError) as broken:
            [_ async for _ in raw.parse()]
        assert "inside an event" in broken.value.message and "a baseline backend" in broken.value.message
        _no_identity(broken.value.message, *tokens)
        # 2. the eagle pool forced while its backend refuses: 502/503 body
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "messages": CHAT}
            async with s.post(
                sp.url + "/v1/chat/completions", json=body, headers={"x-specroute-mode": "eagle"}
            ) as r:
                text = await r.text()
                assert r.status in (502, 503), text
                _no_identity(text + json.dumps(dict(r.headers)), *tokens)
                assert "an eagle backend" in text or "no healthy backend" in text
            # 3. /ready: counts per pool, no names (the dead eagle backend is found out by now or soon)
            ready: dict = {}

            async def eagle_down() -> bool:
                nonlocal ready
                async with s.get(sp.url + "/ready") as r:
                    ready = await r.json()
                return ready.get("healthy") == {"baseline": 1, "eagle": 0}

            assert await wait_until(eagle_down, 20.0, interval_s=0.1), ready
            assert ready["status"] == "ready"
            _no_identity(json.dumps(ready), *tokens)
            # 4. /server_info: the backend's address and key are not relayed
            async with s.get(sp.url + "/server_info") as r:
                info = await r.json()
            assert info["max_total_num_tokens"] == 1000 and info["api_key"] == "**********"
            assert "host" not in info and "port" not in info
            _no_identity(json.dumps(info), *tokens, "10.9.8.7", "sk-backend-key-1")
            # 5. /metrics is for operators: it names the backends, by URL only when unnamed
            async with s.get(sp.url + "/metrics") as r:
                metrics = await r.text()
            assert f'backend="{NAME if named else rb.url}"' in metrics
            assert (rb.url in metrics) is not named
        await client.close()
        sp.signal(signal.SIGTERM)
        assert await sp.wait() == 0
        log = (await stderr).decode()
        assert (NAME if named else rb.url) in log  # operators still see which backend broke
        assert ("2 backend(s) have no name" in log) is not named  # and are told how to hide URLs
    finally:
        await rb.stop()


async def test_names_are_shown_when_backend_header_is_on(fake_backend, proxy):
    fb = await fake_backend()
    dead = closed_port_url()
    p = await proxy(
        baseline=[f"{NAME}={fb.url}"], eagle=[f"eagle-x9={dead}"], policy="fixed", health_checks=False,
        allow_client_override=True,
    )  # fmt: skip
    async with aiohttp.ClientSession() as s:
        async with s.post(
            p.url + "/v1/chat/completions",
            json={"model": "m", "messages": CHAT},
            headers={"x-specroute-mode": "eagle"},
        ) as r:
            assert "eagle-x9" in (await r.json())["error"]["message"]
        async with s.get(p.url + "/ready") as r:
            ready = await r.json()
    assert set(ready["healthy_backends"]) == {NAME, "eagle-x9"}
    assert ready["healthy"] == {"baseline": 1, "eagle": 1}


def test_for_clients_rewrites_every_mention_and_nothing_else():
    ident = BackendIdentity(
        [
            ("gpu-0", "http://10.0.0.1:30000", "baseline"),
            ("http://127.0.0.1:4444", "http://127.0.0.1:4444", "eagle"),
        ],
        show=False,
    )
    assert (
        ident.for_clients("backend gpu-0 refused the connection")
        == "a baseline backend refused the connection"
    )
    assert ident.for_clients("backend http://127.0.0.1:4444 stream broke") == "an eagle backend stream broke"
    assert ident.for_clients("chose backend 'gpu-0', which") == "chose a baseline backend, which"
    assert ident.for_clients("to 127.0.0.1:4444 failed") == "to an eagle backend failed"
    assert ident.for_clients("gpu-00 and xgpu-0 stay") == "gpu-00 and xgpu-0 stay"
    shown = BackendIdentity([("gpu-0", "http://h:1", "baseline")], show=True)
    assert shown.for_clients("backend gpu-0 broke") == "backend gpu-0 broke"
