"""The emulator's SGLang `--speculative-adaptive`: the draft depth of each step follows the decode
batch (its ladder's buckets, each with SGLang's EMA controller), shown on /server_info and /metrics
(`sglang:spec_num_steps`), in the per-request acceptance, and in the speed: the plain server's
step where it stops drafting. Timing is checked on the engine's step times, not on wall clocks."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import openai
import pytest
from helpers import KIMI, run_specroute, wait_until
from prometheus_client.parser import text_string_to_metric_families

from policies.adaptive import AdaptiveSpeed, DepthModel
from policies.ladder import SGLANG_DEFAULT, Ladder, next_steps, parse_ladder
from simulator.emulator.adaptive import AdaptiveDrafting
from simulator.emulator.app import EmulatorConfig, EmulatorServer, run_emulator

MakeEmu = Callable[..., Awaitable[EmulatorServer]]


@pytest.fixture
def emulator_time_scale() -> float:
    return 0.05


def gauges(text: str) -> dict[str, float]:
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith(("sglang:spec_num", "sglang:spec_accept_length", "sglang:num_running"))
    }


async def metrics(server: EmulatorServer) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
        return gauges(await r.text())


async def completions(server: EmulatorServer, n: int, tokens: int) -> list[dict[str, float]]:
    """`n` requests at once; each one's spec details (meta_info of the native route)."""

    async def one() -> dict[str, float]:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
        async with aiohttp.ClientSession() as s, s.post(server.url + "/generate", json=body) as r:
            assert r.status == 200
            meta: dict[str, float] = (await r.json())["meta_info"]
            return meta

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def test_depth_follows_the_batch_on_metrics_and_per_request(emulator: MakeEmu) -> None:
    server = await emulator(
        "eagle", speculative_adaptive=True, max_running_requests=128, stats_interval_steps=1
    )
    info = await _json(server.url + "/server_info")
    assert info["speculative_adaptive"] is True and info["speculative_adaptive_config"] is None
    assert info["speculative_num_steps"] == 3 and info["max_running_requests"] == 128
    assert info["disable_cuda_graph"] is True
    alone = await completions(server, 1, 40)
    # one request: bucket 1 starts at 3 steps and stays (kimi's acceptance, EMA ~1.4 drafts)
    assert (await metrics(server))["sglang:spec_num_steps"] == 3.0
    assert alone[0]["spec_verify_ct"] < 39 and alone[0]["spec_accept_length"] > 1.5
    crowd = asyncio.ensure_future(completions(server, 80, 80))
    # 80 at once: bucket 64 drafts nothing
    assert await wait_until(lambda: _off(server), timeout_s=60, interval_s=0.05)
    seen = await metrics(server)
    assert seen["sglang:spec_num_draft_tokens"] == 0.0
    assert seen["sglang:spec_accept_length"] == pytest.approx(1.0, abs=0.05)  # one token a step
    accept = sorted(m["spec_accept_length"] for m in await crowd)
    assert accept[len(accept) // 2] < 1.3 < alone[0]["spec_accept_length"]  # most steps at 0


async def _off(server: EmulatorServer) -> bool:
    seen = await metrics(server)
    return seen["sglang:num_running_reqs"] >= 64 and seen["sglang:spec_num_steps"] == 0.0


async def _json(url: str) -> dict[str, object]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        doc: dict[str, object] = await r.json()
        return doc


def test_step_times_are_the_depth_s() -> None:
    """The engine's step at depth 0 is the plain step, at the profile's depth the EAGLE-3 verify step."""
    config = EmulatorConfig(mode="eagle", profile=KIMI, speculative_adaptive=True, time_scale=0.5)
    depth = config.depth
    assert depth.steps == 3 and config.ladder is not None
    speed = AdaptiveSpeed(KIMI.speed("baseline"), KIMI.speed("eagle"), depth)
    for b in (1, 40, 80):
        assert speed.step_s(b, 0) == KIMI.speed("baseline").step_time(b)
        assert speed.step_s(b, 3) == pytest.approx(2.4 * KIMI.speed("eagle").step_time(b))


async def test_the_engine_runs_each_step_at_its_bucket_s_depth() -> None:
    """Inside the running engine: the depth it picks per batch and the wall time it waits."""
    config = EmulatorConfig(mode="eagle", profile=KIMI, speculative_adaptive=True, max_running_requests=128)
    async with run_emulator(config) as server:
        engine = server.emulator.engine
        assert engine.step_depth(1) == 3 and engine.step_depth(40) == 1 and engine.step_depth(64) == 0
        assert engine.step_seconds(80, 0) == pytest.approx(KIMI.speed("baseline").step_time(80))
        assert engine.step_seconds(1, 3) == pytest.approx(2.4 * KIMI.speed("eagle").step_time(1))


def test_the_controller_moves_as_sglang_s() -> None:
    """Fed accepted drafts step by step, a bucket decides every `update_interval` steps after
    `warmup_batches`, with `next_steps`; at 0 steps it probes the next candidate."""
    ladder = Ladder(SGLANG_DEFAULT.buckets, initial_steps=3)
    speed = AdaptiveSpeed(KIMI.speed("baseline"), KIMI.speed("eagle"), DepthModel.of(KIMI.mode("eagle")))
    drafting = AdaptiveDrafting(ladder, speed, random.Random(0))
    assert [drafting.steps_for(b) for b in (1, 8, 32, 64)] == [3, 3, 1, 0]
    bucket = ladder.bucket_at(8)
    steps, ema, seen = 3, 2.0, []
    for i in range(1, 41):  # nothing accepted at batch 8
        drafting.observe(8, [0] * 8)
        if steps > 0:
            ema = 0.8 * ema
        after = i - bucket.warmup_batches
        if after > 0 and after % bucket.update_interval == 0:
            steps, ema = next_steps(bucket, steps, ema)
        seen.append(drafting.steps_for(8))
        assert seen[-1] == steps, i
    assert seen[:10] == [3] * 10 and 0 in seen and 1 in seen  # dropped to 0, then probed 1
    assert drafting.steps_for(1) == 3  # another bucket, untouched


def test_acceptance_per_request_follows_its_factor() -> None:
    speed = AdaptiveSpeed(KIMI.speed("baseline"), KIMI.speed("eagle"), DepthModel.of(KIMI.mode("eagle")))
    drafting = AdaptiveDrafting(SGLANG_DEFAULT, speed, random.Random(1))
    mean = sum(drafting.drafts(2.4, 3) for _ in range(20000)) / 20000
    assert mean == pytest.approx(1.4, abs=0.05)  # the profile's accept length, bonus token aside
    assert max(drafting.drafts(3.9, 1) for _ in range(200)) == 1  # never more than the depth
    assert all(drafting.drafts(2.4, 0) == 0 for _ in range(100))


def test_config(tmp_path: Path) -> None:
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps({"1": {"candidate_steps": [2, 4]}, "16": {"candidate_steps": [0]}}))
    config = EmulatorConfig(
        mode="eagle", profile=KIMI, speculative_adaptive=True, speculative_adaptive_config=str(path),
        speculative_num_steps=2,
    )  # fmt: skip
    assert config.ladder is not None and config.ladder.describe() == "1:2/4,16:0"
    assert config.ladder.initial == 2
    compact = EmulatorConfig(
        mode="eagle", profile=KIMI, speculative_adaptive=True, speculative_adaptive_config="1:3,64:0"
    )
    given = parse_ladder("1:3,64:0")
    assert given is not None and compact.ladder is not None
    assert compact.ladder.same_depths(Ladder(given.buckets, initial_steps=3))
    assert EmulatorConfig(mode="eagle", profile=KIMI).ladder is None
    for kw, why in (
        ({"mode": "baseline", "speculative_adaptive": True}, "needs mode eagle"),
        ({"mode": "eagle", "speculative_adaptive_config": str(path)}, "needs speculative_adaptive"),
        ({"mode": "eagle", "speculative_adaptive": True, "speculative_adaptive_config": str(path)},
         "not one of the ladder's steps"),
        ({"mode": "eagle", "speculative_adaptive": True, "speculative_adaptive_config": "/nonexistent.json"},
         "cannot read"),
        ({"mode": "eagle", "speculative_adaptive": True, "profile": KIMI.model_copy(
            update={"modes": {"eagle": KIMI.modes["eagle"]}})}, "baseline"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            EmulatorConfig(**{"profile": KIMI, **kw})  # type: ignore[arg-type]


async def test_emulate_command_flags(tmp_path: Path) -> None:
    code, _, err = await run_specroute(
        "emulate", "--mode", "eagle", "--speculative-adaptive", "--speculative-adaptive-config", "1:x",
        "--port", "0", timeout_s=60,
    )  # fmt: skip
    assert code == 2 and "speculative_adaptive_config" in err and "MIN_BATCH:STEPS" in err
    assert "Traceback" not in err


async def test_openai_answers_are_whole(emulator: MakeEmu) -> None:
    server = await emulator("eagle", speculative_adaptive=True)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    try:
        r = await c.completions.create(model="m", prompt="hi", max_tokens=25, extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 25
    finally:
        await c.close()
