"""Engines as a seam: vLLM's /metrics mapped to the load view (gauges, accept length from counter
rates, the cap it runs at), engine detection, the bounded line filter, and a proxy in front of a
vLLM-shaped backend (health path, SGLang-only routes, warnings naming the engine)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fakes import FakeBackend
from helpers import wait_until

from controller.proxy.engines import SGLANG, VLLM, detect, parse_vllm_metrics
from controller.proxy.scrape import SCRAPE_LIMIT_BYTES, BackendScraper

# Shaped as vLLM 0.32 (CPU) prints it: HELP/TYPE lines, `engine` and `model_name` labels, counters
# with `_total` and `_created` samples, histograms. Trimmed from a real answer.
VLLM_HEADER = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 11223.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny-llama"} {drafts}
vllm:spec_decode_num_drafts_created{engine="0",model_name="tiny-llama"} 1.796160356861391e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of spec decoding draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny-llama"} {draft_tokens}
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny-llama"} {accepted}
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny-llama",position="0"} 730.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} {waiting}
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} {waiting}
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} {queries}
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} {hits}
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny-llama"} {generated}
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny-llama"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 25.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny-llama"} 25.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny-llama"} 1.1789352893829346
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",kv_cache_size_tokens="262144",num_gpu_blocks="2048"} 1.0
"""


def vllm_metrics(
    running: float = 0,
    waiting: float = 0,
    drafts: float = 0,
    accepted: float = 0,
    queries: float = 0,
    hits: float = 0,
    generated: float = 0,
) -> str:
    values = {
        "running": running, "waiting": waiting, "drafts": drafts, "draft_tokens": drafts * 4,
        "accepted": accepted, "queries": queries, "hits": hits, "generated": generated,
    }  # fmt: skip
    text = VLLM_HEADER
    for key, value in values.items():
        text = text.replace("{" + key + "}", f"{float(value)!r}")
    return text


def test_vllm_gauges_and_accept_length_from_counter_rates() -> None:
    first = parse_vllm_metrics(vllm_metrics(running=8, waiting=2, drafts=100, accepted=150), 10.0)
    assert first is not None
    sample, counters = first
    assert (sample.running, sample.queued, sample.engine) == (8.0, 2.0, "vllm")
    assert sample.kv_usage == 0.25 and sample.cache_tokens == 262144
    # A lifetime counter says nothing about now: no accept length from the first scrape alone.
    assert sample.accept_length is None
    second = parse_vllm_metrics(
        vllm_metrics(running=8, drafts=300, accepted=750, queries=1000, hits=250, generated=900),
        12.0,
        counters,
    )
    assert second is not None
    sample, counters = second
    # 600 accepted over 200 drafts in the interval: 3 per draft, plus the bonus token.
    assert sample.accept_length == pytest.approx(4.0)
    assert sample.gen_throughput == pytest.approx(450.0)
    assert sample.cache_hit_rate == pytest.approx(0.25)
    # No draft in the next interval: the last rate stands; a restart (counters back) as well.
    for text in (vllm_metrics(drafts=300, accepted=750), vllm_metrics(drafts=5, accepted=2)):
        parsed = parse_vllm_metrics(text, 13.0, counters)
        assert parsed is not None and parsed[0].accept_length == pytest.approx(4.0)
        counters = parsed[1]


def test_vllm_cap_is_the_full_batch_seen_while_requests_wait() -> None:
    counters = None
    caps = []
    for running, waiting in [(5, 0), (16, 3), (16, 1), (12, 0), (16, 4), (16, 2)]:
        parsed = parse_vllm_metrics(vllm_metrics(running=running, waiting=waiting), 1.0, counters)
        assert parsed is not None
        sample, counters = parsed
        caps.append(sample.max_running)
    # Reported once three scrapes saw the same full batch with requests waiting.
    assert caps == [None, None, None, None, 16, 16]


def test_plain_vllm_has_no_accept_length_and_garbage_gives_none() -> None:
    plain = 'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_waiting{engine="0"} 0\n'
    parsed = parse_vllm_metrics(plain, 0.0)
    assert parsed is not None and parsed[0].running == 3.0 and parsed[0].accept_length is None
    assert parse_vllm_metrics("this is {not prometheus", 0.0) is None
    assert parse_vllm_metrics('sglang:num_running_reqs{tp_rank="0"} 1\n', 0.0) is None


def test_detect_engine_from_sample_names() -> None:
    assert detect(["python_gc_objects_collected_total", "vllm:num_requests_running"]) is VLLM
    assert detect(["sglang:num_running_reqs"]) is SGLANG
    assert detect(["process_cpu_seconds_total"]) is None


async def _metrics_server(body: Callable[[], bytes]) -> tuple[str, web.AppRunner]:
    async def metrics(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        data = body()
        for i in range(0, len(data), 100_000):  # chunked, no Content-Length: read to the end
            await resp.write(data[i : i + 100_000])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}", runner


async def test_a_large_metrics_answer_is_filtered_and_an_oversized_one_refused() -> None:
    # 4 MB of other samples around vLLM's: the wanted lines are found wherever they fall. The
    # filtering's CPU budget is out of reach here (how fast a busy machine filters is no test's
    # business: benchmarks/scrape_stall.py measures it); the next test exceeds one at once.
    filler = "".join(f'other_metric{{i="{i}"}} {i}.0\n' for i in range(100_000)).encode()
    state: dict[str, bytes] = {"body": filler + vllm_metrics(running=7, waiting=1).encode() + filler}
    url, runner = await _metrics_server(lambda: state["body"])
    try:
        scraper = BackendScraper(url, budget_s=math.inf)
        async with aiohttp.ClientSession() as session:
            sample = await scraper.scrape(session, 1.0)
            assert sample is not None and (sample.running, sample.queued) == (7.0, 1.0)
            assert scraper.engine is VLLM and scraper.has_loads is False
            state["body"] = filler * (SCRAPE_LIMIT_BYTES // len(filler) + 1)
            assert await scraper.scrape(session, 2.0) is None
    finally:
        await runner.cleanup()


async def test_a_metrics_answer_past_its_filtering_budget_gives_no_sample() -> None:
    filler = "".join(f'other_metric{{i="{i}"}} {i}.0\n' for i in range(100_000)).encode()
    url, runner = await _metrics_server(lambda: filler + vllm_metrics(running=7, waiting=1).encode())
    try:
        scraper = BackendScraper(url, budget_s=0.0)  # any CPU spent filtering is over it
        async with aiohttp.ClientSession() as session:
            assert await scraper.scrape(session, 1.0) is None
    finally:
        await runner.cleanup()


async def test_an_oversized_v1_loads_is_not_parsed_and_metrics_still_count() -> None:
    """SGLang's /v1/loads is a few hundred bytes per rank: a 7.8 MB one is refused unparsed (JSON
    is parsed in one call, so its size bounds the loop stall) and /metrics is used alone."""
    rank = {"num_running_reqs": 99, "num_waiting_reqs": 0, "padding": "x" * 1000}
    huge = json.dumps({"loads": [rank] * 7800}).encode()
    metrics = b'sglang:num_running_reqs{tp_rank="0"} 5\nsglang:num_queue_reqs{tp_rank="0"} 1\n'

    async def loads(request: web.Request) -> web.Response:
        return web.Response(body=huge, content_type="application/json")

    async def prom(request: web.Request) -> web.Response:
        return web.Response(body=metrics, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/metrics", prom)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        scraper = BackendScraper(f"http://127.0.0.1:{runner.addresses[0][1]}")
        async with aiohttp.ClientSession() as session:
            sample = await scraper.scrape(session, 1.0)
        assert len(huge) > 7_800_000
        assert sample is not None and (sample.running, sample.queued, sample.source) == (5.0, 1.0, "metrics")
        assert scraper.engine is SGLANG and scraper.has_loads is False
    finally:
        await runner.cleanup()


def _vllm_backend(backend: FakeBackend, **values: float) -> None:
    backend.metrics_text = vllm_metrics(**values)


async def test_proxy_in_front_of_vllm_backends(
    fake_backend: Callable[..., Awaitable[FakeBackend]],
    proxy: Callable[..., Awaitable[Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    plain = await fake_backend(ready_route=False)
    spec = await fake_backend(ready_route=False)
    _vllm_backend(plain, running=16, waiting=5)
    _vllm_backend(spec, running=3, drafts=10, accepted=20)
    rp = await proxy(
        baseline=[f"plain={plain.url}"],
        eagle=[f"spec={spec.url}"],
        scrape_interval_s=0.05,
        health_check_interval_s=0.05,
        spec_details=True,
    )
    tracker = rp.tracker
    assert await wait_until(lambda: tracker.get("plain").running == 16 and tracker.get("spec").running == 3)
    _vllm_backend(spec, running=3, drafts=30, accepted=80)  # 60 accepted / 20 drafts: 4.0
    assert await wait_until(lambda: tracker.get("spec").accept_length == pytest.approx(4.0))
    # The cap vLLM runs at (16, seen three times with requests waiting) sets the admission bound.
    margin = rp.settings.admission_margin
    assert await wait_until(lambda: tracker.get("plain").max_in_flight == int(-(-16 * (1 + margin) // 1)))
    # Once the engine is known the probes go to vLLM's /health (no /ready 404 to stumble over).
    plain.probes.clear()
    assert await wait_until(lambda: len(plain.probes) >= 3)
    assert set(plain.probes) == {"/health"}
    async with aiohttp.ClientSession() as s:
        for path, method in (("/generate", "post"), ("/server_info", "get"), ("/get_model_info", "get")):
            async with s.request(method, rp.url + path, json={"text": "hi"}) as r:
                assert r.status == 404
                message = (await r.json())["error"]["message"]
                assert "SGLang route" in message and "vLLM" in message and "/v1/chat/completions" in message
    logs = caplog.text
    assert "backend spec runs vLLM (detected from /metrics)" in logs
    assert "eagle backend spec runs vLLM, which ignores return_spec_tokens_details" in logs
    assert "--per-request-spec-decode-metrics" in logs
    assert "start SGLang" not in logs


async def test_a_profile_far_from_the_servers_is_reported(
    emulator: Callable[..., Awaitable[Any]],
    proxy: Callable[..., Awaitable[Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The emulators run the Kimi profile 20x faster (time_scale 0.05) than the proxy believes it.
    base = await emulator("baseline")
    spec = await emulator("eagle")
    rp = await proxy(baseline=[base.url], eagle=[spec.url], policy="cost_model", profile="kimi-k25-int4-8gpu")
    c = rp.client()
    for i in range(60):  # streamed: an outcome's decode rate needs its token times
        stream = await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=24, temperature=0,
            stream=True,
        )  # fmt: skip
        async for _ in stream:
            pass
    await c.close()
    counts = {
        pool: rp.sample("specroute_profile_mismatches_total", policy="cost_model", pool=pool) or 0.0
        for pool in ("baseline", "eagle")
    }
    assert sum(counts.values()) >= 1, counts
    assert "runs" in caplog.text and "the speed its profile says" in caplog.text
    cal = rp.forwarder.policy.calibration
    pool = max(counts, key=lambda p: counts[p])
    assert cal.mismatch_factor[pool] > 4
