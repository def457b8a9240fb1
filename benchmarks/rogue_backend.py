"""A backend that misbehaves on cue, for the soak (`soak.py`): issue 25's hostile-probe rows.

It relays every request to an upstream SGLang server (the soak's baseline emulator) byte for
byte, except while a mode is set (a line `mode=NAME` on stdin; `mode=` clears it):

  K  a started stream gets a usage event nested 5,000 deep, or with a 5,000-digit count (they
     alternate), after its first chunk; a non-streaming answer's counts become 5,000 digits
  B  a started stream gets a usage event of 10^400 tokens after its first chunk
  I  a stream answers its headers, then closes (empty body), or one event then closes (they alternate)
  C  a stream's first event is deep JSON (`{"error": [[[...` 5,000 deep)
  G  the upstream's events are relayed framed with CRLF (`\\r\\n\\r\\n`)
  H  the first 4 streams of the window get a 50 MB first event before the upstream's
  M  every request is answered "queue full" (stream: 200 + SGLang's error event; else 503)
  J  a non-streaming request is held 8 s (past the soak's first_byte_timeout_s) before it is
     relayed; one the proxy gives up on while held is counted (`cut_while_held`: must stay 0,
     a request run a second time elsewhere would show here)
  A  /metrics answers 7.5 MB of valid samples and /v1/loads 7.8 MB
  N  issue 37's non-finite numbers: /metrics says `sglang:num_running_reqs NaN` and
     `sglang:spec_accept_length +Inf`, /v1/loads `Infinity` running requests
  S  issue 37's large info answers: /server_info, /model_info and /v1/models answer 40 MB of JSON

`GET /_rogue/stats` answers what it did: requests per mode, `cut_while_held`.

    python benchmarks/rogue_backend.py --upstream URL   (prints "listening on URL")
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web

from controller.cli import spawn

DONE = b"data: [DONE]\n\n"
QUEUE_FULL = (
    b'data: {"error": {"object": "error", "message": "The request queue is full.", '
    b'"type": "SERVICE_UNAVAILABLE", "param": null, "code": 503}}\n\n' + DONE
)
DEEP = b"[" * 5000 + b"]" * 5000
CHUNK_HEAD = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"'
HOLD_S = 8.0
H_STREAMS = 4


def _usage_event(count: bytes) -> bytes:
    return (
        b'data: {"id":"x","object":"chat.completion.chunk","choices":[],'
        b'"usage":{"prompt_tokens":1,"completion_tokens":' + count + b',"total_tokens":1}}\n\n'
    )


class Rogue:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.mode = ""
        self.stats: Counter[str] = Counter()
        self.h_left = 0
        self.session: aiohttp.ClientSession | None = None
        self._big_metrics = b"".join(b'sglang:rogue_filler{i="%d"} 1\n' % i for i in range(260_000))[
            :7_500_000
        ]
        self._big_metrics = self._big_metrics[: self._big_metrics.rfind(b"\n") + 1]
        self._big_loads = json.dumps({"loads": [{"filler": "x" * 7_800_000}]}).encode()
        self._big_info = json.dumps({"model_path": "m", "pad": ["x" * 100] * 400_000}).encode()

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        self.h_left = H_STREAMS if mode == "H" else 0

    async def get(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/_rogue/stats":
            return web.json_response(dict(self.stats))
        if self.mode == "N" and request.path in ("/metrics", "/v1/loads"):
            self.stats["N " + request.path] += 1
            if request.path == "/metrics":
                text = (
                    "sglang:num_running_reqs NaN\nsglang:num_queue_reqs 0\nsglang:spec_accept_length +Inf\n"
                )
                return web.Response(text=text, content_type="text/plain")
            return web.Response(
                body=b'{"loads": [{"num_running_reqs": Infinity, "num_waiting_reqs": 0}]}',
                content_type="application/json",
            )
        if self.mode == "S" and request.path in ("/server_info", "/model_info", "/v1/models"):
            self.stats["S " + request.path] += 1
            return web.Response(body=self._big_info, content_type="application/json")
        if self.mode == "A" and request.path in ("/metrics", "/v1/loads"):
            self.stats["A " + request.path] += 1
            big = self._big_metrics if request.path == "/metrics" else self._big_loads
            return web.Response(
                body=big, content_type="text/plain" if request.path == "/metrics" else "application/json"
            )
        assert self.session is not None
        async with self.session.get(self.upstream + request.path_qs) as r:
            return web.Response(
                body=await r.read(),
                status=r.status,
                headers={"Content-Type": r.headers.get("Content-Type", "text/plain")},
            )

    async def post(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: dict[str, Any] = json.loads(raw)
        except ValueError:
            body = {}
        stream = bool(body.get("stream"))
        mode = self.mode
        if mode:
            self.stats[f"{mode} {'stream' if stream else 'whole'}"] += 1
        if mode == "M":
            if stream:
                return await self._raw_stream(request, QUEUE_FULL)
            msg = (
                b'{"object":"error","message":"The request queue is full.",'
                b'"type":"SERVICE_UNAVAILABLE","param":null,"code":503}'
            )
            return web.Response(body=msg, status=503, content_type="application/json")
        if mode == "I" and stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            self.stats["I n"] += 1
            if self.stats["I n"] % 2:
                await resp.write(CHUNK_HEAD + b'a"}}]}\n\n')
            assert request.transport is not None
            request.transport.close()
            return resp
        if mode == "C" and stream:
            return await self._raw_stream(request, b'data: {"error": ' + DEEP + b"}\n\n" + DONE)
        if mode == "J" and not stream:
            try:
                await asyncio.sleep(HOLD_S)
            except asyncio.CancelledError:
                self.stats["cut_while_held"] += 1
                raise
        return await self._relay(request, raw, stream, mode)

    async def _raw_stream(self, request: web.Request, data: bytes) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(data)
        await resp.write_eof()
        return resp

    async def _relay(self, request: web.Request, raw: bytes, stream: bool, mode: str) -> web.StreamResponse:
        assert self.session is not None
        headers = {"Content-Type": "application/json"}
        resp: web.StreamResponse | None = None
        try:
            async with self.session.post(self.upstream + request.path_qs, data=raw, headers=headers) as r:
                if "text/event-stream" not in r.headers.get("Content-Type", ""):
                    data = await r.read()
                    if mode == "K":
                        data = re.sub(
                            rb'("(?:completion|prompt|total)_tokens":\s*)\d+', rb"\g<1>" + b"9" * 5000, data
                        )
                    content_type = r.headers.get("Content-Type", "application/json")
                    return web.Response(body=data, status=r.status, headers={"Content-Type": content_type})
                resp = web.StreamResponse(status=r.status, headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await self._relay_events(r, resp, mode)
                await resp.write_eof()
                return resp
        except (ConnectionError, aiohttp.ClientError):
            # the upstream broke off (the soak's own baseline faults), or the proxy gave the request
            # up: break off the same way
            if request.transport is not None:
                request.transport.abort()
            return resp if resp is not None else web.Response(status=502)

    async def _relay_events(self, r: aiohttp.ClientResponse, resp: web.StreamResponse, mode: str) -> None:
        if mode == "H" and self.h_left > 0:
            self.h_left -= 1
            self.stats["H 50 MB first events"] += 1
            piece = b"y" * (1 << 20)
            await resp.write(CHUNK_HEAD)
            for _ in range(50):
                await resp.write(piece)
            await resp.write(b'"}}]}\n\n')
        first = True
        async for data in r.content.iter_any():
            if mode == "G":
                data = data.replace(b"\n\n", b"\r\n\r\n")
            await resp.write(data)
            if first and mode in ("K", "B"):
                self.stats[f"{mode} n"] += 1
                deep_or_digits = DEEP if self.stats["K n"] % 2 else b"7" * 5000
                await resp.write(_usage_event(b"1" + b"0" * 400 if mode == "B" else deep_or_digits))
            first = False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True)
    args = ap.parse_args()
    rogue = Rogue(args.upstream.rstrip("/"))

    async def run() -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("GET", "/{tail:.*}", rogue.get)
        app.router.add_route("POST", "/{tail:.*}", rogue.post)
        rogue.session = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None),
            headers={"Accept-Encoding": "identity"},
        )
        runner = await spawn.listen(app, handler_cancellation=True)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := (await reader.readline()).decode():
            name, _, value = line.strip().partition("=")
            if name == "mode":
                rogue.set_mode(value)
        await rogue.session.close()
        await runner.cleanup()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
