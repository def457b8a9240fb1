"""Issue 37, finding 3 through the proxy on 127.0.0.1: `online` (serve's default without a
profile) in front of two backends that take the time a real server would -- a TTFT wait, the
prompt's prefill at 8,000 tokens/s, the answer at each pool's decode rate -- on the proxy's
injected clock, so a 240k-token prompt's 30 s of prefill pass without waiting. Before the fix
the pool that prefilled it got none of the others' requests afterwards (0.66 before in the probe);
now each pool's share within 30 s after it is within 10% of its share before."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
from aiohttp import web
from fakes import SSE_DONE, ShiftedClock, sse, stream_chunk, stream_event
from helpers import serve_app

PREFILL_TOK_S = 8000.0
WAIT_S = 0.1
HUGE_CHARS = 4 * 240_000


class ClockedBackend:
    """A chat backend that spends its time on the proxy's clock: before its first event it moves
    the clock by the TTFT wait plus its prompt's prefill (characters / 4 tokens), then by the
    decode of `max_tokens - 1` tokens at `decode_tok_s`, and streams the answer."""

    def __init__(self, clock: ShiftedClock, decode_tok_s: float) -> None:
        self.clock = clock
        self.decode_tok_s = decode_tok_s
        self.prompts: list[int] = []
        self.url = ""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = sum(len(m.get("content") or "") for m in body["messages"]) // 4
        self.prompts.append(prompt)
        tokens = int(body.get("max_tokens") or 16)
        self.clock.advance(WAIT_S + prompt / PREFILL_TOK_S)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(
            sse(stream_chunk("r", "m", True, None, role=True)) + sse(stream_chunk("r", "m", True, "t "))
        )
        self.clock.advance((tokens - 1) / self.decode_tok_s)
        await resp.write(sse(stream_chunk("r", "m", True, "t " * (tokens - 1))))
        await resp.write(sse(stream_chunk("r", "m", True, None, "length")))
        usage = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(sse(stream_event("r", "m", True, [], usage=usage)))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp

    async def _empty(self, request: web.Request) -> web.Response:
        return web.json_response({})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/{tail:.*}", self._empty)
        return app


@pytest.fixture
async def pools() -> AsyncIterator[Callable[..., Any]]:
    async with AsyncExitStack() as stack:

        async def make(clock: ShiftedClock) -> tuple[ClockedBackend, ClockedBackend]:
            base, eagle = ClockedBackend(clock, 100.0), ClockedBackend(clock, 150.0)
            for b in (base, eagle):
                b.url = await stack.enter_async_context(serve_app(b.app()))
            return base, eagle

        yield make


async def test_a_240k_token_prompt_does_not_trap_online(pools, proxy) -> None:
    clock = ShiftedClock()
    base, eagle = await pools(clock)
    p = await proxy(
        baseline=[f"b={base.url}"], eagle=[f"e={eagle.url}"], policy="online", health_checks=False,
        clock=clock, scrape_interval_s=3600, first_byte_timeout_s=3600, idle_timeout_s=3600,
    )  # fmt: skip
    client = p.client()

    async def ask(content: str) -> str:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": content}], max_tokens=32, stream=True
        )
        async for _ in stream:
            pass
        return p.records[-1].decision.pool

    async def phase(seconds: float) -> list[str]:
        """Requests one after the other (prompts of 200 tokens) for `seconds` of the proxy's clock."""
        end = clock() + seconds
        pools: list[str] = []
        while clock() < end:
            pools.append(await ask("x" * 800))
            clock.advance(0.2)  # the client's think time
        return pools

    await phase(300.0)
    before = await phase(60.0)
    await ask("y" * HUGE_CHARS)  # 30 s of prefill, wherever it went; the others pause meanwhile
    assert max(base.prompts + eagle.prompts) >= 240_000 - 1
    after = await phase(30.0)
    await client.close()
    for pool in ("baseline", "eagle"):
        share_before = before.count(pool) / len(before)
        share_after = after.count(pool) / len(after)
        assert abs(share_after - share_before) <= 0.10, (pool, share_before, share_after, len(after))
    assert before.count("eagle") / len(before) >= 0.8  # eagle is the faster pool here
