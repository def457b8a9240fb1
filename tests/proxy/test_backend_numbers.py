"""Issue 37, finding 5: numbers from a backend that are not finite. `sglang:spec_accept_length
+Inf` on `/metrics` (or `Infinity` in `/v1/loads`) reached the view and made every decision-log
record unencodable (0 of 40 written); `sglang:num_running_reqs NaN` raised a traceback on every
scrape and lost that backend's samples. Now such a number is not taken where it is read: it is
counted per backend (`specroute_backend_rejected_values_total`), the backend's first is logged
once, and the rest of what the backend reported is kept."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web
from fakes import FakeBackend
from helpers import metric_samples, wait_until

from controller.proxy.app import SCRAPER
from controller.proxy.config import parse_backend
from controller.proxy.decision_record import decision_record
from controller.proxy.engines import BackendSample, check_sample, read_samples, sglang_sample
from controller.proxy.load import LoadTracker
from controller.proxy.scrape import parse_v1_loads
from controller.proxy.ticket import RequestRecord
from policies.base import BackendLoad, Decision, LoadView, Outcome, PoolLoad, RequestInfo
from policies.registry import PolicyContext, default_registry

CHAT = [{"role": "user", "content": "hello"}]


def test_read_samples_drops_what_is_not_finite_or_absurd_and_counts_it() -> None:
    text = (
        'sglang:num_running_reqs{tp_rank="0"} NaN\n'
        'sglang:num_running_reqs{tp_rank="1"} 3\n'
        "sglang:num_queue_reqs 1e300\n"
        "sglang:spec_accept_length +Inf\n"
        "sglang:gen_throughput -Inf\n"
        "sglang:token_usage 0.5\n"
    )
    rejected: Counter[str] = Counter()
    found = read_samples(text, rejected=rejected)
    assert found is not None
    sample = sglang_sample(found, 0.0)
    assert sample is not None
    assert (sample.running, sample.queued, sample.accept_length, sample.kv_usage) == (3.0, 0.0, None, 0.5)
    assert rejected == {
        "sglang:num_running_reqs": 1,
        "sglang:num_queue_reqs": 1,
        "sglang:spec_accept_length": 1,
        "sglang:gen_throughput": 1,
    }


def test_check_sample_keeps_the_plausible_and_rejects_absurd_counts() -> None:
    fine = BackendSample(running=3, queued=0, taken_at=0.0, accept_length=2.4, kv_usage=0.3)
    assert check_sample(fine) == (fine, ())
    odd = BackendSample(running=3, queued=0, taken_at=0.0, accept_length=1e9, kv_usage=7.0, max_running=0)
    mended, dropped = check_sample(odd)
    assert mended is not None and (mended.accept_length, mended.kv_usage, mended.max_running) == (
        None,
        None,
        None,
    )
    assert set(dropped) == {"accept_length", "kv_usage", "max_running"} and mended.running == 3
    for running, queued in ((math.nan, 0.0), (3.0, -1.0), (5e6, 0.0)):
        assert check_sample(BackendSample(running=running, queued=queued, taken_at=0.0))[0] is None


def test_v1_loads_with_infinity_keeps_the_other_ranks() -> None:
    data = json.loads(
        '{"loads": [{"num_running_reqs": Infinity, "num_waiting_reqs": 0},'
        ' {"num_running_reqs": 2, "num_waiting_reqs": NaN, "speculative": {"accept_length": 1e400}}]}'
    )
    rejected: Counter[str] = Counter()
    sample = parse_v1_loads(data, 0.0, rejected)
    assert sample is not None and (sample.running, sample.queued, sample.accept_length) == (2.0, 0.0, None)
    assert rejected == {"loads:num_running_reqs": 1, "loads:num_waiting_reqs": 1, "loads:accept_length": 1}


def test_record_sample_stores_nothing_implausible() -> None:
    tracker = LoadTracker([parse_backend("b=http://127.0.0.1:1", "baseline")], [])
    assert not tracker.record_sample("b", math.nan, 0, 1.0, 0)
    assert not tracker.record_sample("b", math.inf, 0, 1.0, 0)
    assert tracker.get("b").sample_time is None
    assert tracker.record_sample("b", 2, 1, 1.0, 0, accept_length=math.inf, gen_throughput=math.nan)
    b = tracker.get("b")
    assert (b.running, b.queued, b.accept_length, b.gen_throughput) == (2, 1, None, None)


def test_the_record_writes_whatever_the_view_holds_non_finite_as_null() -> None:
    pol = default_registry(entry_points=False).create("online", {}, PolicyContext(None, 0))
    info = RequestInfo(max_tokens=8)
    view = LoadView(
        PoolLoad("baseline", (BackendLoad("b", "baseline"),)),
        PoolLoad("eagle", (BackendLoad("e", "eagle", accept_length=math.inf, running=1, queued=0),)),
    )
    d = Decision("baseline", "b", "x", {"baseline": 1.0, "eagle": math.nan}, {"baseline": 2.0})
    out = Outcome(info, d, 0.0, math.nan, 8, 1.0, "ok")
    line = decision_record((RequestRecord(info, view, d, d, out, 200, pol), 1.0))
    json.dumps(line, allow_nan=False)  # encodable: nothing non-finite left in it
    assert line["load"]["eagle"]["accept_length"] is None and line["ttft_s"] is None
    assert line["predicted_ttft_s"] == {"baseline": 1.0, "eagle": None} and line["duration_s"] == 1.0


METRICS_NAN = "sglang:num_running_reqs NaN\nsglang:num_queue_reqs 0\n"
METRICS_INF = "sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\nsglang:spec_accept_length +Inf\n"


async def _backend(name: str, metrics: str, loads: bytes | None = None) -> FakeBackend:
    fb = FakeBackend(name, chunks=4)
    fb.metrics_text = metrics
    if loads is not None:

        async def v1_loads(request: web.Request) -> web.Response:
            return web.Response(body=loads, content_type="application/json")

        fb.app.router.add_get("/v1/loads", v1_loads)
    await fb.start()
    return fb


async def test_non_finite_numbers_lose_no_decision_log_line_and_raise_no_traceback(spawn_serve, tmp_path):
    """The probe's reproduction through `serve` (cost_model on the Kimi profile, scraping every
    50 ms): the plain backend says `NaN` running requests on /metrics and `Infinity` on /v1/loads,
    the EAGLE-3 one `+Inf` accept length. All 40 requests' lines are written, the values are
    counted per backend, each backend is logged once, and no scrape raises."""
    loads = b'{"loads": [{"num_running_reqs": Infinity, "num_waiting_reqs": 0}]}'
    plain = await _backend("plain", METRICS_NAN, loads)
    eagle = await _backend("eagle", METRICS_INF)
    path = tmp_path / "decisions.jsonl"
    try:
        sp = await spawn_serve(
            "--baseline", f"plain={plain.url}", "--eagle", f"eagle={eagle.url}",
            "--profile", "kimi-k25-int4-8gpu", "--decision-log", str(path), "--scrape-interval-s", "0.05",
            "--health-check-interval-s", "3600", "--log-level", "WARNING",
        )  # fmt: skip
        assert sp.proc.stderr is not None
        stderr = asyncio.ensure_future(sp.proc.stderr.read())

        async def rejected() -> dict[str, float]:
            samples = await metric_samples(sp.url, "specroute_backend_rejected_values_total")
            out: dict[str, float] = {}
            for labels, v in samples.items():
                out[dict(labels)["backend"]] = out.get(dict(labels)["backend"], 0.0) + v
            return out

        async def both_seen_twice() -> bool:
            got = await rejected()
            return got.get("plain", 0) >= 4 and got.get("eagle", 0) >= 2

        assert await wait_until(both_seen_twice, 20.0, interval_s=0.1)
        values = {
            dict(k)["value"] for k in await metric_samples(sp.url, "specroute_backend_rejected_values_total")
        }
        assert {"sglang:num_running_reqs", "loads:num_running_reqs", "sglang:spec_accept_length"} <= values

        async def one(s: aiohttp.ClientSession, i: int) -> int:
            body: dict[str, Any] = {"model": "m", "messages": CHAT, "max_tokens": 4, "stream": i % 2 == 0}
            async with s.post(sp.url + "/v1/chat/completions", json=body) as r:
                await r.read()
                return r.status

        async with aiohttp.ClientSession() as s:
            statuses = await asyncio.gather(*(one(s, i) for i in range(40)))
        assert statuses == [200] * 40

        def lines() -> list[dict[str, Any]]:
            return [json.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []

        assert await wait_until(lambda: len(lines()) == 40, 20.0)
        assert all(line["status"] == "ok" for line in lines())
        assert all(line["load"]["eagle"]["accept_length"] is None for line in lines())
        dropped = await metric_samples(sp.url, "specroute_decision_log_dropped_records_total")
        assert sum(dropped.values()) == 0.0
        sp.signal()
        assert await sp.wait() == 0
        text = (await stderr).decode()
        assert "Traceback" not in text, text[-3000:]
        assert (
            text.count("backend plain reports numbers") == 1
            and text.count("backend eagle reports numbers") == 1
        )
    finally:
        await plain.stop()
        await eagle.stop()


async def test_a_backend_whose_numbers_recover_is_scraped_again(proxy) -> None:
    """A backend that said NaN is still asked (it answers): once its numbers are plausible again
    its samples reach the view."""
    fb = await _backend("b", METRICS_NAN)
    try:
        p = await proxy(baseline=[f"b={fb.url}"], policy="fixed", health_checks=False, scrape_interval_s=0.02)
        scraper = p.app[SCRAPER]
        assert await wait_until(lambda: scraper.scrapers["b"].rejected["sglang:num_running_reqs"] >= 2, 10.0)
        assert p.tracker.get("b").sample_time is None
        fb.metrics_text = "sglang:num_running_reqs 7\nsglang:num_queue_reqs 2\n"
        assert await wait_until(lambda: p.tracker.get("b").running == 7, 10.0)
        assert p.sample(
            "specroute_backend_rejected_values_total", backend="b", value="sglang:num_running_reqs"
        )
    finally:
        await fb.stop()
