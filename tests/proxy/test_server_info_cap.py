"""SGLang's running-request cap read from `/server_info` (`/get_server_info` on older releases),
preferred over `/v1/loads`' (issue 21): it sets the admission bound and goes into the view
(`BackendLoad.max_running`), where `cost_model` predicts the queue from it. Fake SGLang servers
(real aiohttp apps on 127.0.0.1) for the shapes, hostile answers and older routes; the emulator
(which serves `/server_info` as SGLang does) through the real proxy app for the whole path."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web
from helpers import CHAT, KIMI, wait_until

from controller.bench.sglang_import import parse_server_info
from controller.proxy.engines import server_info_cap
from controller.proxy.scrape import BackendScraper

METRICS = 'sglang:num_running_reqs{tp_rank="0"} 2.0\nsglang:num_queue_reqs{tp_rank="0"} 1.0\n'


def launch_args(cap: int | None, per_dp: list[int] | None) -> dict[str, Any]:
    """A `/server_info` answer of SGLang 0.5: launch arguments and one internal state per DP rank
    (`per_dp`: their effective caps; None: a release whose internal states have none)."""
    states: list[dict[str, Any]] = [{"last_gen_throughput": 1.0}]
    if per_dp is not None:
        states = [{"effective_max_running_requests_per_dp": c, "last_gen_throughput": 1.0} for c in per_dp]
    return {"model_path": "m", "max_running_requests": cap, "dp_size": len(states), "internal_states": states}


@asynccontextmanager
async def sglang(routes: dict[str, Callable[[], web.Response]]) -> AsyncIterator[str]:
    app = web.Application()
    for path, answer in routes.items():

        async def handler(request: web.Request, answer: Callable[[], web.Response] = answer) -> web.Response:
            return answer()

        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def text(body: str) -> Callable[[], web.Response]:
    return lambda: web.Response(text=body, content_type="text/plain")


def js(body: Any) -> Callable[[], web.Response]:
    return lambda: web.json_response(body)


def raw(body: bytes) -> Callable[[], web.Response]:
    return lambda: web.Response(body=body, content_type="application/json")


def loads(cap: int) -> Callable[[], web.Response]:
    return js({"loads": [{"num_running_reqs": 2, "num_waiting_reqs": 1, "max_running_requests": cap}]})


async def scrape(url: str, **kw: Any) -> Any:
    async with aiohttp.ClientSession() as session:
        return await BackendScraper(url, **kw).scrape(session, 0.0)


def test_the_cap_is_the_schedulers_effective_cap_summed_over_dp_ranks_else_the_launch_argument() -> None:
    assert server_info_cap(launch_args(24, [12, 12])) == 24
    assert server_info_cap(launch_args(None, [40])) == 40  # unset: derived from memory
    assert server_info_cap(launch_args(30, None)) == 30  # a release without the effective cap
    assert server_info_cap(launch_args(None, None)) is None
    junk: object
    for junk in (
        [],
        "x",
        {"max_running_requests": True},
        {"max_running_requests": 0},
        {"internal_states": 3},
        {"max_running_requests": 1e300},
        {"max_running_requests": 2.5},
    ):
        assert server_info_cap(junk) is None
    assert server_info_cap({**launch_args(None, [8]), "internal_states": [{"x": 1}, 7]}) is None


def test_bench_reads_the_same_cap_for_the_profile() -> None:
    """`specroute bench` writes the cap into the profile by the same reading: the schedulers'
    effective cap (52, bounded by memory) over the launch argument asked for (64)."""
    info = {**launch_args(64, [52]), "speculative_algorithm": "EAGLE3"}
    assert parse_server_info(info)["max_running_requests"] == 52
    assert parse_server_info(launch_args(48, None))["max_running_requests"] == 48


async def test_server_info_is_preferred_over_v1_loads() -> None:
    async with sglang(
        {"/metrics": text(METRICS), "/v1/loads": loads(100), "/server_info": js(launch_args(24, [12, 12]))}
    ) as url:
        sample = await scrape(url)
    assert (sample.running, sample.queued, sample.max_running) == (2.0, 1.0, 24)


async def test_an_older_release_answers_get_server_info() -> None:
    async with sglang({"/metrics": text(METRICS), "/get_server_info": js(launch_args(30, None))}) as url:
        sample = await scrape(url)
    assert sample.max_running == 30


async def test_a_hostile_server_info_leaves_the_v1_loads_cap() -> None:
    hostile = [
        b"[" * 5000 + b"]" * 5000,
        b'{"max_running_requests": ' + b"7" * 5000 + b"}",
        b'{"internal_states": [' + b'{"effective_max_running_requests_per_dp": 1},' * 8000 + b"{}]}",
        b"not json",
    ]
    for body in hostile:
        async with sglang(
            {"/metrics": text(METRICS), "/v1/loads": loads(100), "/server_info": raw(body)}
        ) as url:
            sample = await scrape(url)
        assert sample is not None and sample.max_running == 100, body[:40]


async def test_a_deeply_nested_v1_loads_gives_the_metrics_sample() -> None:
    """A /v1/loads nested deeper than Python's JSON parser recurses (under the size limit) is no
    load sample: the scrape still returns what /metrics said, it does not raise."""
    deep = b'{"loads": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with sglang({"/metrics": text(METRICS), "/v1/loads": raw(deep)}) as url:
        sample = await scrape(url)
    assert sample is not None and (sample.running, sample.queued) == (2.0, 1.0)


async def test_sglang_without_metrics_gets_its_admission_bound_from_server_info(proxy, fake_backend) -> None:
    """An SGLang started without --enable-metrics (no /metrics, no /v1/loads) still reports its
    cap in /server_info: the admission bound and the view follow it."""
    async with sglang({"/health": js({}), "/server_info": js(launch_args(None, [10]))}) as url:
        p = await proxy(
            baseline=[url], policy="fixed", engine="sglang", scrape_interval_s=0.05, health_checks=False,
            admission_margin=0.25,
        )  # fmt: skip
        assert await wait_until(lambda: p.tracker.get(url).max_running == 10)
        assert p.tracker.get(url).max_in_flight == math.ceil(10 * 1.25)
        (b,) = p.tracker.view(0.0).baseline.backends
        assert b.max_running == 10


async def test_the_emulators_cap_reaches_admission_and_the_policys_view(emulator, proxy) -> None:
    base, eagle = await emulator("baseline"), await emulator("eagle", max_running_requests=2)
    assert KIMI.mode("eagle").max_running_requests == 48  # what the profile says
    async with aiohttp.ClientSession() as s, s.get(eagle.url + "/server_info") as r:
        info = await r.json()
    assert info["max_running_requests"] == 2
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 2
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="cost_model", profile="kimi-k25-int4-8gpu",
        scrape_interval_s=0.05, health_checks=False,
    )  # fmt: skip
    assert await wait_until(lambda: p.tracker.get(eagle.url).max_running == 2)
    assert p.sample("specroute_backend_max_in_flight", pool="eagle", backend=eagle.url) == 3.0  # 2 + 25 %
    c = p.client()
    await c.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
    await c.close()
    await p.wait_idle()
    view = p.records[-1].view
    seen = {b.name: b.max_running for b in view.eagle.backends + view.baseline.backends}
    assert seen == {eagle.url: 2, base.url: KIMI.mode("baseline").max_running_requests}  # 256


async def test_replicas_share_the_learned_and_the_profiles_bounds(proxy, emulator) -> None:
    """With `replicas: 2` each replica admits half of what a backend can run (plus the margin): the
    bound learned from the reported cap and the profile's default alike; a bound set explicitly
    stays as given (it is per replica already)."""
    eagle = await emulator("eagle", max_running_requests=10)
    p = await proxy(
        eagle=[eagle.url], policy="fixed", policy_params={"pool": "eagle"}, profile="kimi-k25-int4-8gpu",
        scrape_interval_s=0.05, health_checks=False, replicas=2, admission_margin=0.25,
    )  # fmt: skip
    # before the first scrape: the profile's 48, plus 25 %, over two replicas
    assert p.tracker.get(eagle.url).max_in_flight in (math.ceil(48 * 1.25 / 2), math.ceil(10 * 1.25 / 2))
    assert await wait_until(lambda: p.tracker.get(eagle.url).max_running == 10)
    assert await wait_until(lambda: p.tracker.get(eagle.url).max_in_flight == math.ceil(10 * 1.25 / 2))  # 7
    assert p.sample("specroute_backend_max_in_flight", pool="eagle", backend=eagle.url) == 7.0
    one = await proxy(
        eagle=[eagle.url], policy="fixed", policy_params={"pool": "eagle"}, scrape_interval_s=0.05,
        health_checks=False, replicas=2, eagle_backend_max_in_flight=9,
    )  # fmt: skip
    assert await wait_until(lambda: one.tracker.get(eagle.url).max_running == 10)
    assert one.tracker.get(eagle.url).max_in_flight == 9
