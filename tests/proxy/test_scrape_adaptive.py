"""What a backend reports about its in-engine adaptive speculation, as the scraper reads it: SGLang's
`/server_info` launch arguments (asked with the cap), vLLM's development `/server_info?config_format=json`
(asked once and then every `recheck_every` scrapes, since vLLM serves it only with
VLLM_SERVER_DEV_MODE=1). Fake servers: real aiohttp apps on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from controller.proxy.scrape import BackendScraper
from policies.ladder import SGLANG_DEFAULT, Ladder

SGLANG_METRICS = 'sglang:num_running_reqs{tp_rank="0"} 2.0\nsglang:num_queue_reqs{tp_rank="0"} 1.0\n'
VLLM_METRICS = 'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'


@asynccontextmanager
async def backend(metrics: str, info: Any | None, asked: list[str]) -> AsyncIterator[str]:
    """A backend serving `metrics` and, unless `info` is None, `/server_info` (404 otherwise)."""

    async def get_metrics(request: web.Request) -> web.Response:
        return web.Response(text=metrics, content_type="text/plain")

    async def server_info(request: web.Request) -> web.Response:
        asked.append(request.path_qs)
        if info is None:
            raise web.HTTPNotFound()
        return web.json_response(info)

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/server_info", server_info)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def scrapes(url: str, n: int, **kw: Any) -> BackendScraper:
    scraper = BackendScraper(url, **kw)
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            await scraper.scrape(session, 0.0)
    return scraper


async def test_sglang_server_info_says_it_adapts() -> None:
    info = {"max_running_requests": 128, "speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
            "speculative_adaptive": True, "speculative_adaptive_config": None}  # fmt: skip
    asked: list[str] = []
    async with backend(SGLANG_METRICS, info, asked) as url:
        scraper = await scrapes(url, 3, recheck_every=60)
    assert scraper.capacity == 128
    assert scraper.adaptive is not None and scraper.adaptive.note is None
    assert scraper.adaptive.ladder is not None
    assert scraper.adaptive.ladder.same_depths(Ladder(SGLANG_DEFAULT.buckets, initial_steps=3))
    assert asked == ["/server_info"]  # once: launch arguments change only with a restart
    custom = {**info, "speculative_adaptive_config": "/srv/ladder.json"}
    async with backend(SGLANG_METRICS, custom, []) as url:
        scraper = await scrapes(url, 1)
    assert scraper.adaptive is not None and scraper.adaptive.note is not None
    assert "/srv/ladder.json" in scraper.adaptive.note
    async with backend(SGLANG_METRICS, {**info, "speculative_adaptive": False}, []) as url:
        scraper = await scrapes(url, 1)
    assert scraper.adaptive is not None and scraper.adaptive.ladder is None


async def test_vllm_reports_its_schedule_only_in_development_mode() -> None:
    spec = {"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 32, 3], [33, 1024, 0]]}
    asked: list[str] = []
    async with backend(VLLM_METRICS, {"vllm_config": {"speculative_config": spec}}, asked) as url:
        scraper = await scrapes(url, 4, recheck_every=2)
    assert scraper.adaptive is not None and scraper.adaptive.ladder is not None
    assert scraper.adaptive.ladder.describe() == "1:3,33:0" and scraper.adaptive.ladder.engine == "vllm"
    assert asked == ["/server_info?config_format=json"] * 3  # the first scrape, then every 2nd
    asked.clear()
    async with backend(VLLM_METRICS, None, asked) as url:  # no VLLM_SERVER_DEV_MODE: 404
        scraper = await scrapes(url, 5, recheck_every=4)
    assert scraper.adaptive is None
    assert asked == ["/server_info?config_format=json"] * 2  # the first scrape and the 4th


async def test_hostile_server_info_is_no_adaptation_and_no_crash() -> None:
    for info in (
        [1, 2],
        {"vllm_config": {"speculative_config": {"num_speculative_tokens_per_batch_size": "x"}}},
    ):
        async with backend(VLLM_METRICS, info, []) as url:
            scraper = await scrapes(url, 1)
        assert scraper.adaptive is None or scraper.adaptive.ladder is None
    async with backend(SGLANG_METRICS, {"speculative_adaptive": True, "speculative_algorithm": 7}, []) as url:
        scraper = await scrapes(url, 1)
    assert scraper.adaptive is not None and scraper.adaptive.ladder is None
