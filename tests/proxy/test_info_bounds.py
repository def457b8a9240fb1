"""Issue 37, finding 4: a backend's large info answer stalled the loop and the memory. 40 MB of
`/server_info` JSON (under the 64 MB response limit) and 4 concurrent `GET /server_info` from any
client took `/health` from 1-2 ms to 12.5-14 s and RSS from 67 to ~1,270 MB, none of it charged
to the memory budget (the answer was parsed on the loop three times). Now an info answer
(`/server_info`, `/model_info`, `/v1/models`) is read up to `info_limit_bytes`, charged to the
memory budget as it is read and until it has been written to the client, and a `/server_info`
answer is parsed once (off the loop when large) within a bound on its JSON structure. Figures
(`/health` p99, RSS): `benchmarks/hostile_bodies.py --scenarios INFO`."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fakes import ShiftedClock
from helpers import assert_openai_error, peak_rss, serve_app, wait_until

from controller.proxy.info import INFO_MAX_VALUES
from controller.proxy.memory import ANSWER_COPIES

INFO_ROUTES = ("/server_info", "/model_info", "/v1/models")


def server_info(pad: int = 0, accept: float = 2.5) -> dict[str, Any]:
    """An SGLang-like `/server_info` padded with `pad` bytes of one string."""
    return {
        "model_path": "m",
        "host": "10.0.0.7",
        "api_key": "sk-secret",
        "max_running_requests": 48,
        "internal_states": [{"avg_spec_accept_length": accept, "effective_max_running_requests_per_dp": 48}],
        "pad": "x" * pad,
    }


class InfoBackend:
    """A backend whose info routes answer `body(path)`, with a Content-Length or chunked; every
    other GET answers 200 `{}`."""

    def __init__(self, body: Callable[[str], bytes], *, chunked: bool = False) -> None:
        self.body = body
        self.chunked = chunked
        self.asked: list[str] = []
        self.url = ""

    async def _get(self, request: web.Request) -> web.StreamResponse:
        if request.path not in INFO_ROUTES:
            return web.json_response({})
        self.asked.append(request.path)
        data = self.body(request.path)
        if not self.chunked:
            return web.Response(body=data, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        try:
            for at in range(0, len(data), 1 << 20):
                await resp.write(data[at : at + (1 << 20)])
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._get)
        return app


@pytest.fixture
async def info_backend() -> AsyncIterator[Callable[..., Any]]:
    async with AsyncExitStack() as stack:

        async def make(body: Callable[[str], bytes], **kw: Any) -> InfoBackend:
            b = InfoBackend(body, **kw)
            b.url = await stack.enter_async_context(serve_app(b.app()))
            return b

        yield make


FORTY_MB = json.dumps(server_info(pad=40 << 20)).encode()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_40_mb_info_answers_are_not_taken_and_cost_no_memory(spawn_serve, info_backend, chunked):
    """The probe's attack through `serve`: a backend answers every info route with 40 MB of JSON,
    4 clients ask each route at once, twice. Every answer is a 502 naming `info_limit_bytes`
    (declared: refused unread; chunked: refused at 4 MiB), `/health` answers all along, the
    process's peak RSS grows by well under 100 MB and the budget holds nothing afterwards."""
    plain = await info_backend(lambda path: FORTY_MB, chunked=chunked)
    eagle = await info_backend(lambda path: FORTY_MB, chunked=chunked)
    sp = await spawn_serve(
        "--baseline", f"b={plain.url}", "--eagle", f"e={eagle.url}", "--policy", "fixed",
        "--health-check-interval-s", "3600", "--log-level", "ERROR",
    )  # fmt: skip
    async with aiohttp.ClientSession() as s:
        async with s.get(sp.url + "/health") as r:
            assert r.status == 200
        before = peak_rss(sp.proc.pid)
        health: list[int] = []
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                async with s.get(sp.url + "/health") as r:
                    health.append(r.status)
                await asyncio.sleep(0.01)

        async def ask(path: str) -> tuple[int, Any]:
            async with s.get(sp.url + path) as r:
                return r.status, await r.json()

        prober = asyncio.create_task(probe())
        for _ in range(2):
            results = await asyncio.gather(*(ask(p) for p in INFO_ROUTES for _ in range(4)))
            for status, body in results:
                assert status == 502, body
                assert_openai_error(body, "info_answer_too_large")
                assert "info_limit_bytes" in body["error"]["message"]
        done.set()
        await prober
        assert health and set(health) == {200}
        text = await (await s.get(sp.url + "/metrics")).text()
    assert "specroute_memory_budget_used_bytes 0.0" in text
    assert peak_rss(sp.proc.pid) - before < 100 << 20


async def test_an_info_answer_is_charged_to_the_memory_budget(info_backend, proxy):
    """A 3 MiB `/model_info` (within `info_limit_bytes`) is relayed byte for byte when the budget
    holds it and refused with 503 `memory_budget_exceeded` (`Retry-After`) when it does not;
    either way the budget holds nothing once the answer has gone."""
    blob = json.dumps({"model_path": "m", "pad": "y" * (3 << 20)}).encode()
    b = await info_backend(lambda path: blob, chunked=True)
    small = await proxy(baseline=[b.url], policy="fixed", health_checks=False, memory_budget_bytes=8 << 20)
    large = await proxy(baseline=[b.url], policy="fixed", health_checks=False)
    assert ANSWER_COPIES * len(blob) > 8 << 20
    async with aiohttp.ClientSession() as s:
        async with s.get(small.url + "/model_info") as r:
            assert r.status == 503 and r.headers["Retry-After"]
            assert_openai_error(await r.json(), "memory_budget_exceeded")
        async with s.get(large.url + "/model_info") as r:
            assert r.status == 200 and await r.read() == blob
            assert r.headers["x-specroute-pool"] == "baseline"
    for p in (small, large):
        assert p.sample("specroute_memory_budget_used_bytes") == 0.0
    assert (small.sample("specroute_memory_budget_refusals_total") or 0) >= 1


async def test_server_info_is_parsed_once_and_a_too_complex_one_refused(info_backend, proxy):
    """A 2 MiB `/server_info` (parsed off the loop) comes back with its secrets masked, the mean
    accept length of the eagle backends and the `specroute` key; one with more JSON values than
    `INFO_MAX_VALUES` is not parsed (502), whatever its size."""
    answers = {"e1": server_info(pad=2 << 20, accept=2.0), "e2": server_info(accept=3.0)}
    e1 = await info_backend(lambda path: json.dumps(answers["e1"]).encode())
    e2 = await info_backend(lambda path: json.dumps(answers["e2"]).encode())
    p = await proxy(
        baseline=[],
        eagle=[f"e1={e1.url}", f"e2={e2.url}"],
        policy="fixed",
        policy_params={"pool": "eagle"},
        health_checks=False,
    )
    async with aiohttp.ClientSession() as s:
        async with s.get(p.url + "/server_info") as r:
            assert r.status == 200
            body = await r.json()
    assert body["api_key"] != "sk-secret" and body["internal_states"][0]["avg_spec_accept_length"] == 2.5
    assert body["specroute"]["accept_length_backends"] == 2 and len(body["pad"]) in (2 << 20, 0)
    assert p.sample("specroute_memory_budget_used_bytes") == 0.0
    numbers = ("[" + ",".join(["0"] * (INFO_MAX_VALUES + 10)) + "]").encode()
    many = await info_backend(lambda path: b'{"internal_states": [], "x": ' + numbers + b"}")
    q = await proxy(
        baseline=[], eagle=[many.url], policy="fixed", policy_params={"pool": "eagle"}, health_checks=False
    )
    async with aiohttp.ClientSession() as s, s.get(q.url + "/server_info") as r:
        assert r.status == 502
        assert_openai_error(await r.json(), "info_answer_too_large")


async def test_a_client_that_does_not_read_an_info_answer_is_cut(info_backend, proxy):
    """A 12 MiB `/model_info` (more than the sockets' buffers hold) to a client that reads nothing:
    the answer is charged while it waits and given back once `client_write_timeout_s` has passed
    on the proxy's clock (the connection is closed)."""
    blob = json.dumps({"pad": "z" * (12 << 20)}).encode()
    b = await info_backend(lambda path: blob)
    clock = ShiftedClock()
    p = await proxy(
        baseline=[b.url], policy="fixed", health_checks=False, clock=clock, client_write_timeout_s=30,
        info_limit_bytes=16 << 20,
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", int(p.url.rsplit(":", 1)[1])))
        await loop.sock_sendall(sock, b"GET /model_info HTTP/1.1\r\nHost: x\r\n\r\n")

        def held() -> float:
            return p.sample("specroute_memory_budget_used_bytes") or 0.0

        assert await wait_until(lambda: held() > 0, 10.0)
        await asyncio.sleep(0.3)
        assert held() > 0  # held while the client does not read
        clock.advance(31)
        assert await wait_until(lambda: held() == 0.0, 10.0)
    finally:
        sock.close()
