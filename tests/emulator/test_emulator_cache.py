"""The emulator's prefix cache: blocks by hand, then what clients see over HTTP (cached_tokens in
usage and meta_info, prefill only for uncached tokens, LRU at capacity, /flush_cache, metrics)."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import aiohttp
import openai
import pytest
from helpers import cache_profile, metric_samples, wait_until
from openai.types.chat import ChatCompletionMessageParam

from policies.prefix import chat_text
from simulator.emulator.cache import PrefixCache

BLOCK = 64  # the emulator's default block, tokens
BLOCK_CHARS = BLOCK * 4


def text_of(n_blocks: int, tag: str) -> str:
    """Exactly `n_blocks` blocks of text that no other tag shares."""
    unit = (tag + " ") * 1000
    return unit[: n_blocks * BLOCK_CHARS]


# -- the cache by hand ------------------------------------------------------------------------


def test_shared_prefix_is_a_hit_and_divergence_is_not() -> None:
    cache = PrefixCache(block_tokens=BLOCK, capacity_tokens=100 * BLOCK)
    common = text_of(4, "system")
    a = cache.blocks_of(common + text_of(3, "alpha"))
    b = cache.blocks_of(common + text_of(3, "beta"))
    assert len(a) == len(b) == 7
    assert a[:4] == b[:4] and a[4] != b[4]
    cached, handle = cache.admit(a, prompt_tokens=7 * BLOCK)
    assert cached == 0
    cache.release(handle)
    cached, handle = cache.admit(b, prompt_tokens=7 * BLOCK)
    assert cached == 4 * BLOCK  # the shared system prompt, not the diverging rest
    cache.release(handle)
    cached, _ = cache.admit(a, prompt_tokens=7 * BLOCK)
    assert cached == 7 * BLOCK - 1  # a whole prompt cached: its last token is still computed


def test_lru_eviction_at_capacity_takes_unreferenced_leaves_first() -> None:
    cache = PrefixCache(block_tokens=BLOCK, capacity_tokens=10 * BLOCK)
    a = cache.blocks_of(text_of(6, "alpha"))
    b = cache.blocks_of(text_of(6, "beta"))
    _, ha = cache.admit(a, 6 * BLOCK)
    cache.release(ha)
    _, hb = cache.admit(b, 6 * BLOCK)
    # 12 blocks for 10 places: a's two deepest blocks went (least recently used leaves)
    assert len(cache) == 10
    assert cache.match(a) == 4 and cache.match(b) == 6
    # b is referenced while it runs: admitting c may evict only a's (unreferenced) blocks
    c = cache.blocks_of(text_of(6, "gamma"))
    _, hc = cache.admit(c, 6 * BLOCK)
    assert cache.match(b) == 6 and cache.match(c) == 6 and cache.match(a) == 0
    assert len(cache) == 12  # everything left is referenced: over capacity until requests end
    cache.release(hb)
    cache.release(hc)
    assert len(cache) == 10
    # a shared parent outlives its children: b's leaves went, not its head
    assert cache.match(b) == 4 and cache.match(c) == 6


def test_flush_is_refused_while_blocks_are_referenced() -> None:
    cache = PrefixCache(block_tokens=BLOCK, capacity_tokens=10 * BLOCK)
    _, h = cache.admit(cache.blocks_of(text_of(2, "alpha")), 2 * BLOCK)
    assert not cache.flush() and len(cache) == 2
    cache.release(h)
    assert cache.flush() and len(cache) == 0


def test_a_finished_request_caches_its_answer_too() -> None:
    cache = PrefixCache(block_tokens=BLOCK, capacity_tokens=100 * BLOCK)
    prompt = cache.blocks_of(text_of(2, "alpha"))
    longer = cache.blocks_of(text_of(2, "alpha") + text_of(3, "answer"))
    _, h = cache.admit(prompt, 2 * BLOCK)
    cache.release(h, longer)
    assert cache.match(longer) == 5


# -- over HTTP --------------------------------------------------------------------------------


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)


async def timed_chat(c: openai.AsyncOpenAI, messages: list[ChatCompletionMessageParam]) -> tuple[float, Any]:
    """(TTFT seconds, the usage chunk) of one streamed chat request."""
    began = time.perf_counter()
    ttft = None
    usage = None
    stream = await c.chat.completions.create(
        model="m", messages=messages, max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    async for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.perf_counter() - began
        if chunk.usage is not None:
            usage = chunk.usage
    assert ttft is not None and usage is not None
    return ttft, usage


def expected_cached(messages: list[ChatCompletionMessageParam]) -> int:
    """What a fully cached chat prompt reports: its whole blocks, at most prompt tokens - 1."""
    blocks = len(chat_text(messages)) // BLOCK_CHARS
    prompt = sum(math.ceil(len(str(m.get("content", ""))) / 4) + 4 for m in messages)
    return min(blocks * BLOCK, prompt - 1)


async def test_a_repeated_prompt_reports_cached_tokens_and_skips_its_prefill(emulator: Any) -> None:
    # 8,000 prompt tokens at 2,000 tok/s: 4 s of prefill (0.4 s wall) the first time, none after
    server = await emulator(
        profile=cache_profile(prefill_tok_s=2000), time_scale=0.1, enable_cache_report=True
    )
    c = client(server.url)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": text_of(125, "question")}]
    first_ttft, first = await timed_chat(c, messages)
    second_ttft, second = await timed_chat(c, messages)
    assert first.prompt_tokens_details is None  # SGLang: null when nothing was cached
    assert second.prompt_tokens_details is not None
    assert second.prompt_tokens_details.cached_tokens == expected_cached(messages)
    assert second_ttft < first_ttft / 2, (first_ttft, second_ttft)


async def test_without_cache_report_the_openai_routes_say_null_and_generate_still_counts(
    emulator: Any,
) -> None:
    server = await emulator()
    c = client(server.url)
    prompt = text_of(10, "prompt")
    for _ in range(2):
        done = await c.completions.create(model="m", prompt=prompt, max_tokens=4)
        assert done.usage is not None and done.usage.prompt_tokens_details is None
    async with aiohttp.ClientSession() as s:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 4}}
        async with s.post(server.url + "/generate", json=body) as r:
            meta = (await r.json())["meta_info"]
    assert meta["cached_tokens"] == min(10 * BLOCK, meta["prompt_tokens"] - 1)


async def test_a_later_turn_hits_the_earlier_turn_and_its_answer(emulator: Any) -> None:
    server = await emulator(enable_cache_report=True)
    c = client(server.url)
    turn1 = [{"role": "system", "content": text_of(8, "system")}, {"role": "user", "content": "hello"}]
    answer = await c.chat.completions.create(model="m", messages=turn1, max_tokens=300)  # type: ignore[arg-type]
    reply = answer.choices[0].message.content or ""
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    again = await c.chat.completions.create(model="m", messages=turn2, max_tokens=4)  # type: ignore[arg-type]
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    # beyond the first turn's prompt: the answer was cached when the first request ended
    covered = len(chat_text([*turn1, {"role": "assistant", "content": reply}])) // BLOCK_CHARS * BLOCK
    assert cached == covered
    assert cached > len(chat_text(turn1)) // BLOCK_CHARS * BLOCK


async def test_lru_eviction_at_capacity_over_http(emulator: Any) -> None:
    server = await emulator(cache_tokens=10 * BLOCK, enable_cache_report=True)
    c = client(server.url)

    async def cached(prompt: str) -> int:
        done = await c.completions.create(model="m", prompt=prompt, max_tokens=1)
        details = done.usage.prompt_tokens_details if done.usage else None
        return 0 if details is None or details.cached_tokens is None else details.cached_tokens

    a, b = text_of(6, "alpha"), text_of(6, "beta")
    assert await cached(a) == 0
    assert await cached(b) == 0  # a's two deepest blocks made room
    assert await cached(a) == 4 * BLOCK


async def test_flush_cache_empties_the_cache_and_is_refused_while_busy(emulator: Any) -> None:
    server = await emulator(enable_cache_report=True)
    c = client(server.url)
    prompt = text_of(4, "alpha")
    await c.completions.create(model="m", prompt=prompt, max_tokens=1)
    async with aiohttp.ClientSession() as s:
        long = asyncio.create_task(c.completions.create(model="m", prompt="busy", max_tokens=2000))
        try:
            assert await wait_until(lambda: server.engine.num_running > 0)
            async with s.post(server.url + "/flush_cache") as r:
                assert r.status == 400
                assert (await r.text()).startswith("Cache flushed.")
        finally:
            long.cancel()
            with pytest.raises((asyncio.CancelledError, openai.APIError)):
                await long
        assert await wait_until(lambda: server.engine.num_running == 0)
        async with s.get(server.url + "/flush_cache") as r:
            assert r.status == 200
            assert (await r.text()).startswith("Cache flushed.")
    done = await c.completions.create(model="m", prompt=prompt, max_tokens=1)
    assert done.usage is not None and done.usage.prompt_tokens_details is None


async def test_cache_metrics_have_sglang_names(emulator: Any) -> None:
    server = await emulator(cache_tokens=50_000)
    c = client(server.url)
    prompt = text_of(20, "alpha")
    for _ in range(2):
        await c.completions.create(model="m", prompt=prompt, max_tokens=1)
    hit = await metric_samples(server.url, "sglang:cache_hit_rate")
    cached = await metric_samples(server.url, "sglang:cached_tokens_total")
    pool = await metric_samples(server.url, "sglang:max_total_num_tokens")
    prompt_tokens = math.ceil(len(prompt) / 4)
    # the last prefill batch was the second request alone: everything but its last token cached
    assert list(hit.values()) == [pytest.approx((prompt_tokens - 1) / prompt_tokens)]
    assert list(cached.values()) == [prompt_tokens - 1]
    assert list(pool.values()) == [50_000]
    assert await metric_samples(server.url, "sglang:token_usage")
    assert await metric_samples(server.url, "sglang:num_used_tokens")
