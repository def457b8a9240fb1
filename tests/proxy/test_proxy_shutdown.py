"""`specroute serve` as a real subprocess: start-up line, SIGTERM first answers /ready with 503
while requests are still served for shutdown_grace_s, then drains running streams; the drain
timeout is honoured (the whole shutdown within grace + drain + 2 s, whatever clients do), SIGHUP
during start-up is remembered, bad settings exit 2 with a message naming the key."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys

import aiohttp
import openai
import pytest
from helpers import BODY, metric_samples, run_specroute, wait_until

from controller.cli import spawn


async def test_sigterm_drains_running_stream_to_completion(fake_backend, spawn_serve):
    fb = await fake_backend(chunks=10, delay_s=0.1)
    sp = await spawn_serve(
        "--baseline", fb.url, "--policy", "fixed", "--drain-timeout-s", "20", "--shutdown-grace-s", "0"
    )
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
    sp = await spawn_serve(
        "--baseline", fb.url, "--policy", "fixed", "--drain-timeout-s", "0.5", "--shutdown-grace-s", "0"
    )
    async with aiohttp.ClientSession() as s:
        resp = await s.post(sp.url + "/v1/chat/completions", json=BODY)
        await resp.content.readuntil(b"\n\n")
        sp.signal(signal.SIGINT)
        assert await sp.wait(timeout_s=30) == 0  # the stalled stream does not hold serve up
        resp.close()
    await wait_until(lambda: fb.active == 0, 3.0)
    assert fb.active == 0 and fb.aborted == 1


async def test_openai_sdk_sees_a_stream_cut_by_the_drain_like_a_broken_backend(fake_backend, spawn_serve):
    """Through the official client, a stream the drain timeout cuts raises what a stream a
    backend broke raises: `openai.APIError` carrying the OpenAI-shaped `stream_broken` error, not
    `APIConnectionError` (the stream ends with the error event and `[DONE]`, not a torn socket)."""
    fb = await fake_backend(chunks=10)
    sp = await spawn_serve(
        "--baseline", fb.url, "--policy", "fixed", "--shutdown-grace-s", "0", "--drain-timeout-s", "0.5"
    )
    client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def stream_error(mode: str, on_first_chunk: signal.Signals | None = None) -> openai.APIError:
        stream = await client.chat.completions.create(**chat, extra_body={"fake_mode": mode})
        texts: list[str] = []
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    texts.append(chunk.choices[0].delta.content)
                    if on_first_chunk is not None and len(texts) == 1:
                        sp.signal(on_first_chunk)
        assert texts, "the stream was cut before its first token"
        assert not isinstance(caught.value, openai.APIConnectionError), repr(caught.value)
        return caught.value

    broken = await stream_error("die_mid")  # the backend drops the connection after 2 tokens
    cut = await stream_error("stall_mid", on_first_chunk=signal.SIGTERM)  # stalls; the drain cuts it
    await client.close()
    assert await sp.wait(timeout_s=30) == 0
    for err in (broken, cut):
        assert isinstance(err.body, dict) and err.body.get("code") == "stream_broken", err.body
        assert type(err) is type(broken)
    assert "shutting down" in cut.message and "shutting down" not in broken.message
    assert fb.aborted == 1  # the stalled upstream request was aborted, not left running


async def _raw_exchange(port: int, request: bytes) -> bytes:
    """One request on a fresh connection; the whole answer (read until the server closes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_sigterm_ready_503_then_grace_period_serves_then_drain(fake_backend, spawn_serve):
    """A balancer outside Kubernetes learns of the shutdown from /ready (503 at once) and still
    gets answers for shutdown_grace_s; only then does the listener close. A stream running then
    finishes in the drain; answers during the grace carry `Connection: close` (a raw HTTP/1.1
    client sees it), so no keep-alive connection outlives the listener. On the process's driven
    clock (`tests/driven_serve.py`): the grace ends when the test moves the clock past it."""
    fb = await fake_backend(chunks=20, delay_s=0.1)  # a 2 s stream, running across the grace
    grace = 20.0  # on the driven clock; below every limit of the stream the advances also move
    sp = await spawn_serve(
        "--baseline", fb.url, "--policy", "fixed", "--shutdown-grace-s", str(grace),
        "--drain-timeout-s", "20", "--log-level", "WARNING", driven=True,
    )  # fmt: skip
    port = int(sp.url.rsplit(":", 1)[1])
    client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    fast = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    loop = asyncio.get_running_loop()

    async def answered() -> int:
        """How many of 3 SDK requests in a row are answered before the first refused one."""
        for i in range(3):
            try:
                out = await client.chat.completions.create(**fast)
            except openai.APIConnectionError:
                return i
            assert out.choices[0].message.content
        return 3

    async with aiohttp.ClientSession() as s:
        async with s.get(sp.url + "/ready") as r:
            assert r.status == 200
        long_stream = await s.post(sp.url + "/v1/chat/completions", json=BODY)
        assert long_stream.status == 200
        await long_stream.content.readuntil(b"\n\n")
        t0 = loop.time()
        sp.signal(signal.SIGTERM)

        async def ready_503() -> bool:
            async with s.get(sp.url + "/ready") as r:
                return r.status == 503

        assert await wait_until(ready_503, 5, interval_s=0.05)
        t_ready_503 = loop.time() - t0
        async with s.get(sp.url + "/ready") as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "shutting_down"
        async with s.get(sp.url + "/health") as r:
            assert r.status == 200  # alive: liveness must not restart a draining process
        raw = await _raw_exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 200 ") and b"\r\nConnection: close\r\n" in raw

        assert await answered() == 3  # at the start of the grace, through the openai SDK
        await sp.advance_clock(grace - 5)
        assert await answered() == 3  # five seconds before its end (real time counts too)
        await sp.advance_clock(5.5)  # past it: the listener closes

        async def refused() -> bool:
            return await answered() < 3

        assert await wait_until(refused, 10, interval_s=0.02)
        t_refused = loop.time() - t0
        assert fb.active == 1  # the stream is still running when the listener has closed ...
        rest = await long_stream.read()
        exit_code = await sp.wait()
        t_exit = loop.time() - t0
    await client.close()
    print(
        f"\nshutdown figures: /ready 503 after {t_ready_503:.3f} s; refused from {t_refused:.2f} s "
        f"(grace {grace:g} s on the driven clock); exit after {t_exit:.2f} s (the stream took ~2 s)"
    )
    assert exit_code == 0
    assert rest.endswith(b"data: [DONE]\n\n") and rest.count(b'"content":"tok') >= 15  # ... and ends
    assert fb.aborted == 0


async def test_second_signal_cuts_the_grace_period_short(fake_backend, spawn_serve):
    """Ctrl-C twice: the operator wants out now, not after shutdown_grace_s."""
    fb = await fake_backend()
    sp = await spawn_serve("--baseline", fb.url, "--policy", "fixed", "--shutdown-grace-s", "600")
    async with aiohttp.ClientSession() as s:
        sp.signal(signal.SIGINT)

        async def ready_503() -> bool:
            async with s.get(sp.url + "/ready") as r:
                return r.status == 503

        assert await wait_until(ready_503, 10)
        sp.signal(signal.SIGINT)
        assert await sp.wait(timeout_s=60) == 0


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


async def test_shutdown_ends_within_drain_plus_two_seconds_whatever_clients_do(fake_backend, spawn_serve):
    """Streaming clients that stopped reading: aiohttp's own shutdown waited drain_timeout_s for
    them, then as long again for the cancelled handlers, so a 3 s drain took over 6 s (the
    shipped 30 s took 62 s, past systemd's TimeoutStopSec=45). Now: drain, cut, exit."""
    fb = await fake_backend(chunks=400_000)  # far more than the socket buffers hold
    drain = 1.0  # long enough that nothing these clients do ends the streams within it
    sp = await spawn_serve(
        "--baseline", fb.url, "--policy", "fixed", "--drain-timeout-s", str(drain), "--log-level", "WARNING",
        "--shutdown-grace-s", "0", stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    port = int(sp.url.rsplit(":", 1)[1])
    body = json.dumps({**BODY, "max_tokens": 400_000}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    loop = asyncio.get_running_loop()
    stuck = []
    for _ in range(3):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, request)
        stuck.append(sock)
    try:
        assert await wait_until(lambda: fb.active == 3, 10)

        async def all_blocked() -> bool:  # the socket buffers are full: the proxy's writes block
            return (await metric_samples(sp.url, "specroute_client_writes_blocked"))[()] == 3.0

        assert await wait_until(all_blocked, 10)
        t0 = loop.time()
        sp.signal(signal.SIGTERM)
        # exit 0 with the clients still stuck: serve cut them, not before the drain timeout (how
        # long the cut takes beside it is measured by benchmarks/shutdown_time.py, not asserted
        # on here)
        assert await sp.wait(timeout_s=30) == 0
        assert loop.time() - t0 >= drain
    finally:
        for sock in stuck:
            sock.close()
    assert await wait_until(lambda: fb.active == 0, 5)


async def test_sighup_during_start_up_is_remembered_not_fatal(fake_backend, tmp_path):
    """SIGHUP's default action ends a process; serve's reload handler exists only once it
    listens, so a `systemctl reload` racing a start killed it (exit 129). The config is read from
    a FIFO here: serve blocks opening it, which is well inside start-up, and gets SIGHUP then."""
    fb = await fake_backend()
    fifo = tmp_path / "specroute.yaml"
    os.mkfifo(fifo)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "controller.cli", "serve", "--port", "0", "--config", str(fifo),
        "--shutdown-grace-s", "0", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        # opening the FIFO for writing succeeds once serve has it open for reading
        async def writer_fd() -> int:
            while True:
                try:
                    return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:
                    assert proc.returncode is None
                    await asyncio.sleep(0.02)

        config = f"baseline: [{fb.url}]\npolicy: fixed\n".encode()
        fd = await asyncio.wait_for(writer_fd(), 30)
        proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.2)
        os.write(fd, config)
        os.close(fd)
        line = await spawn.read_listening(proc, marker="specroute listening on ", timeout_s=30)
        url = spawn.url_of(line)
        fd = await asyncio.wait_for(writer_fd(), 30)  # the remembered reload reads the config again
        os.write(fd, config)
        os.close(fd)
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=BODY) as r:
            assert r.status == 200
            await r.read()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert proc.stderr is not None
        err = (await proc.stderr.read()).decode()
        assert "SIGHUP during start-up" in err  # acted on once serve could
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
