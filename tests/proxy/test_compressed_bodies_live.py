"""Compressed request bodies without a Content-Length (`Transfer-Encoding: chunked`), through the
real `specroute serve` process from a raw client: the decompression ratio limit
(`body_max_compression_ratio`) and the memory budget hold as the body inflates, as they do for a
body that declares its length (`test_hostile_backends_live.py::test_l2_a_gzip_bomb_is_refused_by_its_ratio`
there)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import zlib

import aiohttp
from fakes import FakeBackend
from helpers import assert_openai_error, peak_rss, port_of

BUDGET = 64 * 1024 * 1024


def deflate(data: bytes) -> bytes:
    c = zlib.compressobj(9)
    return c.compress(data) + c.flush()


async def post_chunked(url: str, compressed: bytes, encoding: str, piece: int = 8192) -> tuple[int, bytes]:
    """POST `compressed` to /v1/completions as a chunked body with `Content-Encoding: encoding`
    (no Content-Length); the status and body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(url))
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: " + encoding.encode() + b"\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n"
        )
        try:
            for i in range(0, len(compressed), piece):
                part = compressed[i : i + piece]
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            pass  # refused before its end: the answer is what counts
        raw = await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():  # one chunk is enough for a small JSON error
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return status, body


async def test_a_chunked_gzip_bomb_is_refused_by_its_ratio_and_memory_is_bounded(spawn_serve, fake_backend):
    """Each bomb is 30 KB on the wire and inflates to 30 MB (under `body_limit_bytes`, 32 MB): only
    the ratio refuses it. 24 at once, with a 64 MiB budget: every one a 413, none reaches the
    backend, the proxy's peak RSS stays under the budget plus 150 MB, and it serves afterwards."""
    good: FakeBackend = await fake_backend()
    sp = await spawn_serve(
        "--baseline", good.url, "--memory-budget-bytes", str(BUDGET), "--log-level", "ERROR",
    )  # fmt: skip
    bomb = gzip.compress(json.dumps({"model": "m", "prompt": "x" * (30 << 20)}).encode(), 9)
    assert len(bomb) < 64 * 1024
    results = await asyncio.gather(*(post_chunked(sp.url, bomb, "gzip") for _ in range(24)))
    for status, body in results:
        assert status == 413, (status, body[:300])
        error = json.loads(body)
        assert_openai_error(error, "payload_too_large")
        assert "inflates more than 100 times" in error["error"]["message"]
    assert good.requests == []
    assert peak_rss(sp.proc.pid) <= BUDGET + 150 * 1024 * 1024
    async with aiohttp.ClientSession() as s, s.get(sp.url + "/health") as r:
        assert r.status == 200  # still up
    ok = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4}).encode()
    status, body = await post_chunked(sp.url, gzip.compress(ok), "gzip")
    assert status == 200, body[:300]
    assert good.requests[-1]["prompt"] == "hello"


async def test_a_chunked_deflate_bomb_is_refused_and_a_fair_one_is_served(spawn_serve, fake_backend):
    """deflate as gzip; and a chunked compressed body within the ratio (random text: about 1.3x)
    larger than the check's first slice is relayed whole, decoded."""
    good: FakeBackend = await fake_backend()
    sp = await spawn_serve("--baseline", good.url, "--log-level", "ERROR")
    bomb = deflate(json.dumps({"model": "m", "prompt": "y" * (20 << 20)}).encode())
    status, body = await post_chunked(sp.url, bomb, "deflate")
    assert status == 413, body[:300]
    assert_openai_error(json.loads(body), "payload_too_large")
    assert good.requests == []
    prompt = os.urandom(600_000).hex()  # 1.2 MB of text, well past the first 128 KiB slice
    fair = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()
    status, body = await post_chunked(sp.url, deflate(fair), "deflate")
    assert status == 200, body[:300]
    assert good.requests[-1]["prompt"] == prompt
