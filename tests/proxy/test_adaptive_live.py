"""serve in front of an EAGLE-3 server that adapts its draft depth in-engine (the emulator's SGLang
`--speculative-adaptive`): it reads the adaptation from `/server_info`, rebuilds its policy to
predict the ladder's speed, and predicts what the server then does -- the EAGLE-3 speed for a
lone request, the plain speed at batch >= 64, where a server still drafting 3 steps on the kimi
profile would be twice as slow. Configured ladders (`backend_adaptive`) win over reports.

Wall-clock bounds here are loose (a shared 2-core machine must pass, emulators and proxy share
one event loop); the 15% figures come from `benchmarks/adaptive_live.py`."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from helpers import KIMI, wait_until

from controller.proxy.app import ADMIN, FORWARDER, SCRAPER
from controller.proxy.ticket import RequestRecord
from policies.base import Pool
from policies.profile import SpeedModel, load_profile
from simulator.emulator.app import EmulatorServer
from simulator.engine.deployment import server_profile

TIME_SCALE = 0.25
KIMI_NAME = "kimi-k25-int4-8gpu"
MakeEmu = Callable[..., Awaitable[EmulatorServer]]


def wall_profile(tmp_path: Path) -> str:
    """The kimi profile in wall time (the emulators run it at TIME_SCALE)."""
    path = tmp_path / "kimi-wall.json"
    path.write_text(
        server_profile(KIMI, speed={"baseline": 1 / TIME_SCALE, "eagle": 1 / TIME_SCALE}).to_json()
    )
    return str(path)


def eagle_speed(proxy: Any) -> SpeedModel:
    """What the running policy (cost_model) predicts the eagle pool with."""
    speed: SpeedModel = proxy.app[FORWARDER].policy._eagle
    return speed


async def scraped(proxy: Any, scrapes: int) -> None:
    """Wait until every backend has been scraped `scrapes` times (its /server_info read)."""
    backends = len(proxy.settings.backends())
    assert await wait_until(lambda: proxy.app[SCRAPER].samples >= scrapes * backends, timeout_s=30)


async def closed_loop(client: openai.AsyncOpenAI, clients: int, rounds: int, seed: int) -> None:
    """`clients` workers, each sending `rounds` requests one after the other; answer lengths drawn
    40..80 so that completions do not come in waves."""
    rng = random.Random(seed)
    lengths = [[rng.randint(40, 80) for _ in range(rounds)] for _ in range(clients)]

    async def worker(mine: list[int]) -> None:
        for n in mine:
            r = await client.completions.create(
                model="m", prompt="hello", max_tokens=n, extra_body={"ignore_eos": True}
            )
            assert r.usage is not None and r.usage.completion_tokens == n

    await asyncio.gather(*(worker(m) for m in lengths))


def ratios(records: list[RequestRecord], pool: Pool, low: int, high: int) -> list[tuple[float, float]]:
    """(measured, predicted) end-to-end seconds of the requests decided with `low <= batch <= high`
    (the batch they joined: the backend's load at the decision plus themselves)."""
    out = []
    for r in records:
        batch = r.decision.backend_load + 1
        predicted = r.chosen.predicted_e2e_s.get(pool)
        if r.outcome.status == "ok" and predicted is not None and low <= batch <= high:
            out.append((r.outcome.duration_s, predicted))
    return out


async def test_serve_reads_the_ladder_and_predicts_the_adaptive_server(
    emulator: MakeEmu, proxy: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specroute")
    profile = wall_profile(tmp_path)
    adaptive = await emulator(
        "eagle",
        time_scale=TIME_SCALE,
        speculative_adaptive=True,
        max_running_requests=128,
        stats_interval_steps=5,
    )
    plain = await emulator(
        "baseline", time_scale=TIME_SCALE, max_running_requests=256, stats_interval_steps=5
    )
    params = {"calibrate": False}
    on_eagle = await proxy(eagle=[adaptive.url], policy="cost_model", policy_params=params, profile=profile)
    on_plain = await proxy(baseline=[plain.url], policy="cost_model", policy_params=params, profile=profile)
    assert eagle_speed(on_eagle).speculating is None  # the profile's fixed EAGLE-3 mode, until it reports
    # its /server_info says --speculative-adaptive (SGLang's default ladder): the policy is rebuilt
    assert await wait_until(lambda: eagle_speed(on_eagle).speculating is not None, timeout_s=30)
    assert any("eagle pool: adapting: 1:1/3/5/7,8:0/1/3,32:0/1,64:0" in m for m in caplog.messages)
    speed = eagle_speed(on_eagle)
    wall = load_profile(profile).speed("baseline")
    assert speed.decode_tok_s(80) == pytest.approx(wall.decode_tok_s(80))  # the plain floor

    async with openai.AsyncOpenAI(base_url=on_eagle.base_url, api_key="k", max_retries=0, timeout=60) as c:
        for _ in range(6):  # alone: 3 steps, the EAGLE-3 speed
            await c.completions.create(
                model="m", prompt="hello", max_tokens=48, extra_body={"ignore_eos": True}
            )
        await closed_loop(c, 80, 3, seed=1)
    async with openai.AsyncOpenAI(base_url=on_plain.base_url, api_key="k", max_retries=0, timeout=60) as c:
        await closed_loop(c, 80, 3, seed=1)

    alone = ratios(on_eagle.records[:6], "eagle", 1, 1)
    crowd = ratios(on_eagle.records[6 + 80 :], "eagle", 64, 128)
    floor = ratios(on_plain.records[80:], "baseline", 64, 128)
    assert len(alone) == 6 and len(crowd) >= 40 and len(floor) >= 40, (len(alone), len(crowd), len(floor))

    def mean(pairs: list[tuple[float, float]], i: int) -> float:
        return statistics.fmean(p[i] for p in pairs)

    # predicted: at batch >= 64 the adaptive server is the plain one (the draft model's prefill of a
    # one-word prompt aside)
    assert mean(crowd, 1) == pytest.approx(mean(floor, 1), rel=0.05)
    # measured against predicted: loose bounds; a server still drafting 3 steps would be ~2.1x
    for pairs in (alone, crowd):
        assert 0.7 < mean(pairs, 0) / mean(pairs, 1) < 1.6, pairs[:5]
    # and against the plain server under the same load
    assert 0.7 < mean(crowd, 0) / mean(floor, 0) < 1.4
    figures = [f"{mean(p, 0):.3f}/{mean(p, 1):.3f} s (n={len(p)})" for p in (alone, crowd, floor)]
    print("measured/predicted: alone {}, crowd {}, plain {}".format(*figures))  # with -s


async def test_a_configured_ladder_wins_over_the_report(
    emulator: MakeEmu, proxy: Any, tmp_path: Path
) -> None:
    adaptive = await emulator("eagle", speculative_adaptive=True)
    fixed = await emulator("eagle")
    plain = await emulator("baseline")
    # configured: adapting from the start, and what the backend reports does not move it
    told = await proxy(
        baseline=[plain.url], eagle=[f"e1={fixed.url}"], policy="cost_model", profile=KIMI_NAME,
        backend_adaptive={"e1": "[[1,16,3],[17,256,0]]"},
    )  # fmt: skip
    first = told.app[FORWARDER].policy
    assert eagle_speed(told).speculating is not None
    assert eagle_speed(told).decode_tok_s(17) == pytest.approx(KIMI.speed("baseline").decode_tok_s(17))
    await scraped(told, 2)  # it reports no adaptation
    assert told.app[FORWARDER].policy is first
    # a reload (SIGHUP) builds the new policy through the same adaptation
    told.app[ADMIN].reload(told.settings.model_copy(update={"policy_params": {"objective": "ttft"}}))
    assert told.app[FORWARDER].policy is not first and eagle_speed(told).speculating is not None
    # two eagle backends adapting differently (one does, one does not): the profile's fixed mode
    mixed = await proxy(
        baseline=[plain.url],
        eagle=[adaptive.url, fixed.url],
        policy="cost_model",
        profile=KIMI_NAME,
    )
    await scraped(mixed, 2)
    assert eagle_speed(mixed).speculating is None
    # off: a reporting backend is predicted as fixed EAGLE-3 when told so
    off = await proxy(
        baseline=[plain.url], eagle=[f"a1={adaptive.url}"], policy="cost_model", profile=KIMI_NAME,
        backend_adaptive={"a1": "off"},
    )  # fmt: skip
    await scraped(off, 2)
    assert eagle_speed(off).speculating is None
    assert off.app[ADMIN].name == "cost_model"


def test_backend_adaptive_setting_errors_name_the_backend() -> None:
    from pydantic import ValidationError

    from controller.proxy.config import Settings, load_settings

    ok = Settings.model_validate({"eagle": ["e1=http://127.0.0.1:9"], "backend_adaptive": {"e1": "sglang"}})
    assert ok.backend_adaptive == {"e1": "sglang"}
    environ = {"SPECROUTE_EAGLE": "e1=http://127.0.0.1:9", "SPECROUTE_BACKEND_ADAPTIVE": '{"e1": [[1,8,2]]}'}
    env = load_settings({}, environ)
    assert env.backend_adaptive == {"e1": [[1, 8, 2]]}
    for bad, why in (
        ({"b1": "sglang"}, "'b1' is not the name of an eagle backend"),
        ({"e1": "1:x"}, "backend_adaptive['e1']: ladder '1:x'"),
        ({"e1": [[2, 8, 1]]}, "start at batch 1"),
    ):
        with pytest.raises(ValidationError, match=re.escape(why)):
            Settings.model_validate(
                {
                    "baseline": ["b1=http://127.0.0.1:8"],
                    "eagle": ["e1=http://127.0.0.1:9"],
                    "backend_adaptive": bad,
                }
            )
