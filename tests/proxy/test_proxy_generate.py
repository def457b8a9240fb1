"""SGLang's native API through the proxy: `POST /generate` (streamed and not) routed with the same
policy, accounting, failover and metrics as the OpenAI routes, and `GET /server_info`,
`/model_info` (and their `/get_*` names) answered as one SGLang server would. A plain aiohttp
client sends the bodies SGLang's serving benchmark sends (`sglang_bench`); the backends are
emulated SGLang servers on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from fakes import ShiftedClock
from helpers import assert_in_flight_zero, assert_openai_error, wait_until
from sglang_bench import generate_body, read_generate_stream

from simulator.emulator import synthetic
from simulator.emulator.app import EmulatorServer, FaultConfig

if TYPE_CHECKING:
    from conftest import RunningProxy

MakeEmu = Callable[..., Awaitable[EmulatorServer]]
MakeProxy = Callable[..., Awaitable["RunningProxy"]]
PROMPT = "Summarise the plot of Hamlet in three sentences."


async def _pair(
    emulator: MakeEmu, proxy: MakeProxy, **settings: Any
) -> tuple[EmulatorServer, EmulatorServer, RunningProxy]:
    base = await emulator("baseline")
    eagle = await emulator("eagle")
    settings.setdefault("policy", "threshold")
    p = await proxy(baseline=[base.url], eagle=[eagle.url], **settings)
    return base, eagle, p


async def test_streamed_generate_as_sglang_bench_sends_it(emulator: MakeEmu, proxy: MakeProxy) -> None:
    _, _, p = await _pair(emulator, proxy)
    async with aiohttp.ClientSession() as s:
        runs = await asyncio.gather(
            *(read_generate_stream(s, p.url + "/generate", generate_body(PROMPT, 48)) for _ in range(6))
        )
    for got in runs:
        assert got.status == 200 and got.done, got.events[-3:]
        assert got.headers["Content-Type"].startswith("text/event-stream")
        assert got.headers["x-specroute-pool"] in ("baseline", "eagle")
        assert got.output_len == 48 and got.text == synthetic.text(0, 48)
        assert got.last["meta_info"]["finish_reason"] == {"type": "length", "length": 48}
    # the same accounting as the OpenAI routes: every request, its tokens, its decision
    assert len(p.records) == 6
    for r in p.records:
        assert (r.request.endpoint, r.request.stream, r.request.max_tokens) == ("generate", True, 48)
        assert r.request.prompt_tokens == len(PROMPT) // 4
        assert r.outcome.status == "ok" and r.outcome.completion_tokens == 48 and r.outcome.ttft_s is not None
    pools = [r.decision.pool for r in p.records]
    tokens = sum(p.sample("specroute_output_tokens_total", pool=pool) or 0 for pool in set(pools))
    assert tokens == 6 * 48
    ok = sum(
        p.sample("specroute_requests_total", pool=r.decision.pool, backend=r.decision.backend, status="ok")
        or 0
        for r in {(r.decision.backend): r for r in p.records}.values()
    )
    assert ok == 6
    await assert_in_flight_zero(p.url)


async def test_generate_not_streamed_and_with_n(emulator: MakeEmu, proxy: MakeProxy) -> None:
    base, _, p = await _pair(emulator, proxy, policy="fixed", policy_params={"pool": "baseline"})
    async with aiohttp.ClientSession() as s:
        async with s.post(p.url + "/generate", json=generate_body(PROMPT, 12, stream=False)) as r:
            assert r.status == 200 and r.headers["x-specroute-pool"] == "baseline"
            out = await r.json()
        direct_keys = list(out)
        async with s.post(base.url + "/generate", json=generate_body(PROMPT, 12, stream=False)) as r:
            assert list(await r.json()) == direct_keys == ["text", "output_ids", "meta_info"]
        assert out["meta_info"]["completion_tokens"] == 12
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "n": 3, "ignore_eos": True}}
        async with s.post(p.url + "/generate", json=body) as r:
            assert r.status == 200
            outs = await r.json()
        assert [o["meta_info"]["completion_tokens"] for o in outs] == [4, 4, 4]
        # no max_new_tokens: the policy is told SGLang's default budget of 128 tokens
        async with s.post(
            p.url + "/generate", json={"text": "hi", "sampling_params": {"ignore_eos": True}}
        ) as r:
            assert (await r.json())["meta_info"]["completion_tokens"] == 128
    assert [r.outcome.completion_tokens for r in p.records] == [12, 12, 128]
    assert [r.request.max_tokens for r in p.records] == [12, 4, 128]
    assert p.records[1].request.prompt_tokens == 3  # one per token id


async def test_generate_streamed_with_n_counts_tokens(emulator: MakeEmu, proxy: MakeProxy) -> None:
    _, _, p = await _pair(emulator, proxy, policy="fixed", policy_params={"pool": "eagle"})
    body = {
        **generate_body(PROMPT, 20),
        "sampling_params": {"max_new_tokens": 20, "n": 2, "ignore_eos": True},
    }
    async with aiohttp.ClientSession() as s:
        got = await read_generate_stream(s, p.url + "/generate", body)
    assert got.done and {e["index"] for e in got.events if isinstance(e, dict)} == {0, 1}
    # the samples end together here, so both last outputs are in the tail the proxy keeps
    assert p.records[0].outcome.completion_tokens == 40


async def test_bad_generate_bodies_get_a_clear_400(emulator: MakeEmu, proxy: MakeProxy) -> None:
    _, _, p = await _pair(emulator, proxy)
    cases = [
        ({"text": ["a", "b"]}, "batch"),
        ({"input_ids": [[1, 2], [3]]}, "batch"),
        ({"sampling_params": {"max_new_tokens": 3}}, "'text' or 'input_ids' is required"),
        ({"text": 7}, "'text' must be a string"),
        ({"text": "x", "sampling_params": [{"max_new_tokens": 3}]}, "'sampling_params' must be an object"),
        ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"text": "x", "stream": "yes"}, "'stream' must be a boolean"),
    ]
    async with aiohttp.ClientSession() as s:
        for body, needle in cases:
            async with s.post(p.url + "/generate", json=body) as r:
                assert r.status == 400, body
                err = await r.json()
            assert_openai_error(err, "invalid_request")
            assert needle in err["error"]["message"], (body, err)
        async with s.post(p.url + "/generate", data=b"{not json") as r:
            assert r.status == 400
    assert p.records == []
    assert p.sample("specroute_rejected_requests_total", code="400") == len(cases) + 1
    # what the backend refuses is relayed as SGLang sent it
    async with aiohttp.ClientSession() as s:
        too_long = {"input_ids": [1] * 300000, "sampling_params": {"max_new_tokens": 3}}
        async with s.post(p.url + "/generate", json=too_long) as r:
            assert r.status == 400 and "context length" in (await r.json())["error"]["message"]


async def test_generate_fails_over_on_a_full_queue_and_a_dropped_connection(
    emulator: MakeEmu, proxy: MakeProxy
) -> None:
    base = await emulator("baseline")
    eagle = await emulator("eagle", max_running_requests=1, time_scale=1.0,
                           faults=FaultConfig(max_queued_requests=0))  # fmt: skip
    clock = ShiftedClock()
    p = await proxy(baseline=[base.url], eagle=[eagle.url], policy="fixed", policy_params={"pool": "eagle"},
                    health_checks=False, overload_backoff_s=60, clock=clock)  # fmt: skip
    holder_body = {"text": "hold", "sampling_params": {"max_new_tokens": 100000, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s:
        holder = asyncio.create_task(s.post(eagle.url + "/generate", json=holder_body))
        assert await wait_until(lambda: eagle.engine.num_running == 1)
        # streamed: SGLang's queue-full is a 200 whose one output is an abort with status 503
        got = await read_generate_stream(s, p.url + "/generate", generate_body(PROMPT, 16))
        assert got.status == 200 and got.done and got.output_len == 16
        assert (
            got.headers["x-specroute-pool"] == "baseline" and got.headers["x-specroute-reason"] == "failover"
        )
        async with s.post(p.url + "/generate", json=generate_body(PROMPT, 8, stream=False)) as r:
            # eagle backs off its queue-full for overload_backoff_s: routed around, not tried
            assert r.status == 200 and r.headers["x-specroute-reason"] == "eagle_unavailable"
        eagle.engine.abort_all()
        (await holder).close()
        eagle.faults.max_queued_requests = None
        clock.advance(60)  # the back-off is over
        eagle.faults.refuse_connections = True  # the connection closes before any answer
        async with s.post(p.url + "/generate", json=generate_body(PROMPT, 8, stream=False)) as r:
            assert r.status == 200 and r.headers["x-specroute-pool"] == "baseline"
    assert p.sample("specroute_failovers_total", pool="eagle") == 2
    assert [r.outcome.status for r in p.records] == ["ok"] * 3
    await assert_in_flight_zero(p.url)


async def test_client_leaving_a_generate_stream_aborts_it(emulator: MakeEmu, proxy: MakeProxy) -> None:
    base = await emulator("baseline", time_scale=1.0)
    p = await proxy(baseline=[base.url], eagle=[], policy="fixed", policy_params={"pool": "baseline"})
    body = generate_body(PROMPT, 100000)
    async with aiohttp.ClientSession() as s:
        async with s.post(p.url + "/generate", json=body) as r:
            await r.content.readuntil(b"\n\n")
            assert base.engine.num_running == 1
    assert await wait_until(lambda: base.engine.num_running == 0, timeout_s=10)
    await assert_in_flight_zero(p.url)
    assert await wait_until(lambda: len(p.records) == 1)
    assert p.records[0].outcome.status == "client_closed"


# -- /server_info and /model_info --------------------------------------------------------------


async def _get(url: str) -> tuple[int, Any, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)


async def test_server_info_carries_the_eagle_pools_accept_length(emulator: MakeEmu, proxy: MakeProxy) -> None:
    base = await emulator("baseline")
    eagles = [await emulator("eagle", seed=seed, accept_length=a) for seed, a in ((1, 2.0), (2, 3.2))]
    p = await proxy(baseline=[base.url], eagle=[e.url for e in eagles], policy="fixed",
                    policy_params={"pool": "eagle"})  # fmt: skip
    async with aiohttp.ClientSession() as s:
        for e in eagles:  # some traffic on each eagle server, straight to it
            async with s.post(e.url + "/generate", json=generate_body(PROMPT, 200, stream=False)) as r:
                assert r.status == 200
    lengths = []
    for e in eagles:
        _, info, _ = await _get(e.url + "/server_info")
        lengths.append(info["internal_states"][0]["avg_spec_accept_length"])
    for path in ("/server_info", "/get_server_info"):
        status, info, headers = await _get(p.url + path)
        assert status == 200 and headers["x-specroute-pool"] == "eagle"
        assert "x-specroute-backend" not in headers
        # what SGLang's benchmark reads
        assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(sum(lengths) / 2)
        assert info["speculative_algorithm"] == "EAGLE3"
        assert info["specroute"] == {
            "pool": "eagle",
            "accept_length_backends": 2,
            "healthy_backends": {"baseline": 1, "eagle": 2},
        }
    # no eagle backend answers: the baseline's own answer
    for e in eagles:
        e.faults.refuse_connections = True
    status, info, headers = await _get(p.url + "/server_info")
    assert status == 200 and headers["x-specroute-pool"] == "baseline"
    assert (
        info["speculative_algorithm"] is None and "avg_spec_accept_length" not in info["internal_states"][0]
    )
    for path in ("/model_info", "/get_model_info"):
        status, info, headers = await _get(p.url + path)
        assert status == 200 and info["model_path"] == "specroute-emulated" and "tokenizer_path" in info
        assert headers["x-specroute-pool"] == "baseline"
    base.faults.refuse_connections = True
    for path in ("/server_info", "/model_info"):
        status, body, _ = await _get(p.url + path)
        assert status == 503
        assert_openai_error(body, "no_healthy_backend")
