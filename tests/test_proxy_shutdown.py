"""`specroute serve` as a real subprocess: start-up line, SIGTERM drains running streams, the drain
timeout is honoured, bad settings exit 2 with a message naming the key."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest
from helpers import run_specroute, wait_until

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def test_sigterm_drains_running_stream_to_completion(fake_backend, spawn_serve):
    fb = await fake_backend(chunks=10, delay_s=0.1)
    sp = await spawn_serve("--baseline", fb.url, "--policy", "fixed", "--drain-timeout-s", "20")
    async with aiohttp.ClientSession() as s:
        resp = await s.post(sp.url + "/v1/chat/completions", json=BODY)
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        sp.signal(signal.SIGTERM)
        rest = await resp.read()
        body = first + rest
        assert body.endswith(b"data: [DONE]\n\n")
        assert body.count(b'"content":"tok') == 10
        assert await sp.wait() == 0
        with pytest.raises(aiohttp.ClientConnectionError):
            async with s.get(sp.url + "/health") as r:
                await r.read()
    assert fb.completed == 1 and fb.aborted == 0


async def test_drain_timeout_cuts_streams_and_aborts_upstream(fake_backend, spawn_serve):
    fb = await fake_backend(chunks=10)
    fb.mode = "stall_mid"
    sp = await spawn_serve("--baseline", fb.url, "--policy", "fixed", "--drain-timeout-s", "0.5")
    async with aiohttp.ClientSession() as s:
        resp = await s.post(sp.url + "/v1/chat/completions", json=BODY)
        await resp.content.readuntil(b"\n\n")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sp.signal(signal.SIGINT)
        assert await sp.wait(timeout_s=20) == 0
        assert loop.time() - t0 < 10
        resp.close()
    await wait_until(lambda: fb.active == 0, 3.0)
    assert fb.active == 0 and fb.aborted == 1


async def test_serve_prints_real_port_and_serves(fake_backend, spawn_serve):
    fb = await fake_backend()
    sp = await spawn_serve("--eagle", fb.url, "--policy", "fixed", "--policy-param", "pool=eagle")
    assert sp.url.startswith("http://127.0.0.1:") and not sp.url.endswith(":0")
    async with aiohttp.ClientSession() as s, s.post(sp.url + "/v1/chat/completions", json=BODY) as r:
        assert r.status == 200 and r.headers["x-specroute-pool"] == "eagle"
        await r.read()
    sp.signal(signal.SIGTERM)
    assert await sp.wait() == 0


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--baseline", "http://127.0.0.1:1", "--port", "abc"], {}, "port (from flag --port)"),
        (["--baseline", "ftp://nope"], {}, "baseline (from flag --baseline)"),
        (
            ["--baseline", "http://127.0.0.1:1"],
            {"SPECROUTE_IDLE_TIMEOUT_S": "-1"},
            "SPECROUTE_IDLE_TIMEOUT_S",
        ),
        (["--baseline", "http://127.0.0.1:1", "--policy", "nosuch"], {}, "unknown policy 'nosuch'"),
        (["--baseline", "http://127.0.0.1:1", "--policy-param", "threshold=0"], {}, "threshold"),
        (["--baseline", "http://127.0.0.1:1", "--profile", "no-such-profile"], {}, "no-such-profile"),
        ([], {}, "no backend configured"),
    ],
)
async def test_serve_rejects_bad_settings_with_exit_2(args, env, needle):
    import os

    code, _, text = await run_specroute(
        "serve", *args,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("SPECROUTE_")}, **env}, timeout_s=60,
    )  # fmt: skip
    assert code == 2
    assert text.startswith("specroute serve: error: ") and needle in text, text
    assert "Traceback" not in text


async def test_serve_rejects_an_unknown_log_level():
    """A typo in --log-level is an error at start-up, not a silent INFO (the server would run)."""
    code, _, err = await run_specroute(
        "serve", "--baseline", "http://127.0.0.1:1", "--port", "0", "--log-level", "LOUD", timeout_s=30
    )
    assert code == 2
    assert "--log-level: invalid choice: 'LOUD'" in err and "Traceback" not in err
