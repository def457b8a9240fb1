"""The SGLang emulator, through real HTTP on 127.0.0.1:0: the official `openai` client for
answers, raw SSE for the exact chunk shape, Prometheus text for the metrics. Timing checks are
coarse directions only (a loaded 2-core machine must pass)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from helpers import KIMI, run_specroute, start_module, wait_until
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from simulator.emulator import synthetic
from simulator.emulator.app import EmulatorConfig, EmulatorServer, FaultConfig

MakeEmu = Callable[..., Awaitable[EmulatorServer]]


@pytest.fixture
def emulator_time_scale() -> float:
    return 0.2


_CLIENTS: list[openai.AsyncOpenAI] = []


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _CLIENTS:
        await _CLIENTS.pop().close()


def client(server: EmulatorServer, api_key: str = "unused") -> openai.AsyncOpenAI:
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0)
    _CLIENTS.append(c)
    return c


async def sse(url: str, body: dict[str, Any], **kw: Any) -> tuple[int, list[Any]]:
    """POST and return (status, decoded events); `[DONE]` is kept as the string."""
    async with aiohttp.ClientSession() as s, s.post(url, json=body, **kw) as r:
        text = await r.text()
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return r.status, events


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        return await r.json()


MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write a haiku about routers."}]
CHAT = {"model": "kimi", "messages": MESSAGES}


# -- answers and shapes ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["baseline", "eagle"])
async def test_openai_client_non_streaming_exact_usage(emulator: MakeEmu, mode: str) -> None:
    server = await emulator(mode)
    c = client(server)
    r = await c.chat.completions.create(
        model="kimi", messages=MESSAGES, max_tokens=17, extra_body={"ignore_eos": True}
    )
    assert r.model == "kimi"
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.completion_tokens == 17
    assert r.usage.total_tokens == r.usage.prompt_tokens + 17
    assert r.usage.prompt_tokens > 0
    text = r.choices[0].message.content or ""
    assert len(text.split()) + text.count(",") + text.count(".") >= 1
    cr = await c.completions.create(
        model="kimi", prompt="Paris is", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert cr.object == "text_completion"
    assert cr.usage is not None and cr.usage.completion_tokens == 5
    assert cr.choices[0].finish_reason == "length"


async def test_streaming_chat_chunk_sequence_matches_sglang(emulator: MakeEmu) -> None:
    server = await emulator("baseline")
    body = {
        **CHAT,
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, events = await sse(server.url + "/v1/chat/completions", body)
    assert status == 200
    first, *content, finish, usage, done = events
    assert done == "[DONE]"
    rid = first["id"]
    assert len(rid) == 32 and all(e["id"] == rid for e in events[:-1])
    assert first["object"] == "chat.completion.chunk" and first["model"] == "kimi"
    assert first["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None and first["choices"][0]["matched_stop"] is None
    # One token per step on a plain server; a late read (a loaded machine) takes the tokens of
    # several steps in one chunk, as SGLang does, so only the total is exact.
    assert 1 <= len(content) <= 6
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == synthetic.text(0, 6)
    assert all(set(c["choices"][0]["delta"]) == {"reasoning_content", "content"} for c in content)
    assert finish["choices"][0]["delta"] == {"reasoning_content": None}
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 6
    assert set(usage["usage"]) == {
        "prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
        "reasoning_tokens", "completion_tokens_details",
    }  # fmt: skip


async def test_eagle_chunks_carry_several_tokens_and_usage_is_exact(emulator: MakeEmu) -> None:
    server = await emulator("eagle")
    c = client(server)
    stream = await c.chat.completions.create(
        model="kimi",
        messages=MESSAGES,
        max_tokens=120,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        elif chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert usage is not None and usage.completion_tokens == 120
    # The first token is alone; then one chunk per verify step with ~2.4 tokens on average.
    assert 1 + 119 / 4 <= len(pieces) < 90
    assert sum(p.count(" ") + p.count(",") + p.count(".") - p.count(" ,") for p in pieces) >= 100


async def test_completions_stream_carries_finish_on_last_content_chunk(emulator: MakeEmu) -> None:
    server = await emulator("baseline")
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True, "stream": True}
    status, events = await sse(server.url + "/v1/completions", body)
    assert status == 200
    *chunks, done = events
    assert done == "[DONE]"
    *running, last = chunks
    assert [c["choices"][0]["finish_reason"] for c in running] == [None] * len(running)
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == synthetic.text(0, 3)
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)


async def test_without_max_tokens_length_is_drawn_and_stops_at_eos(emulator: MakeEmu) -> None:
    server = await emulator("baseline", output_tokens_mean=12, output_tokens_cv=0.0, time_scale=0.05)
    body = {**CHAT, "stream": False}
    async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/chat/completions", json=body) as r:
        data = await r.json()
    assert data["object"] == "chat.completion"
    assert data["usage"]["completion_tokens"] == 12
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["choices"][0]["matched_stop"] == server.emulator.config.eos_token_id
    assert data["metadata"] == {"weight_version": "default"}
    # max_tokens below the natural length truncates with "length"
    r2 = await client(server).chat.completions.create(model="x", messages=MESSAGES, max_tokens=4)
    assert (
        r2.choices[0].finish_reason == "length" and r2.usage is not None and r2.usage.completion_tokens == 4
    )


async def test_info_endpoints(emulator: MakeEmu) -> None:
    server = await emulator("eagle", model="kimi-k2.5", stats_interval_steps=1)
    models = await get_json(server.url + "/v1/models")
    assert models["data"][0]["id"] == "kimi-k2.5" and models["data"][0]["owned_by"] == "sglang"
    await client(server).chat.completions.create(
        model="kimi-k2.5", messages=MESSAGES, max_tokens=40, extra_body={"ignore_eos": True}
    )
    for path in ("/server_info", "/get_server_info"):
        info = await get_json(server.url + path)
        state = info["internal_states"][0]
        assert state["effective_max_running_requests_per_dp"] == 48
        assert 1.0 < state["avg_spec_accept_length"] <= 4.0
        assert info["speculative_algorithm"] == "EAGLE3" and info["max_running_requests"] == 48
    loads = await get_json(server.url + "/v1/loads")
    load = loads["loads"][0]
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    assert load["max_running_requests"] == 48
    assert 1.0 < load["speculative"]["accept_length"] <= 4.0
    for path in ("/health", "/health_generate", "/ready"):
        async with aiohttp.ClientSession() as s, s.get(server.url + path) as r:
            assert r.status == 200


async def test_metrics_names_and_labels(emulator: MakeEmu) -> None:
    server = await emulator("eagle", stats_interval_steps=2)
    await client(server).chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=30, extra_body={"ignore_eos": True}
    )
    async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
        text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
                 "sglang:spec_accept_length"):  # fmt: skip
        (sample,) = families[name].samples
        assert set(sample.labels) == {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}
    assert families["sglang:spec_accept_length"].samples[0].value > 1.0
    assert families["sglang:time_to_first_token_seconds"].type == "histogram"
    assert families["sglang:inter_token_latency_seconds"].type == "histogram"
    gen = families["sglang:generation_tokens"]
    assert [s.value for s in gen.samples if s.name == "sglang:generation_tokens_total"] == [30.0]
    count = [s for s in families["sglang:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert count[0].value == 1.0 and count[0].labels == {"model_name": "specroute-emulated"}


# -- batching, queueing, aborts ----------------------------------------------------------


async def _decode_rate(c: openai.AsyncOpenAI, tokens: int) -> float:
    """Per-request decode tok/s seen by a streaming client (after the first token)."""
    loop = asyncio.get_running_loop()
    stream = await c.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=tokens, stream=True, extra_body={"ignore_eos": True}
    )
    first = last = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = loop.time()
            first = first or last
    assert first is not None and last is not None
    return (tokens - 1) / (last - first)


async def test_batching_slows_each_request_as_concurrency_rises(emulator: MakeEmu) -> None:
    server = await emulator("baseline", time_scale=0.5)
    c = client(server)
    solo = await _decode_rate(c, 40)
    crowd = await asyncio.gather(*(_decode_rate(c, 40) for _ in range(20)))
    # Profile: 92.7 tok/s alone, ~27 tok/s at 20 (x0.5 time scale doubles both); coarse bounds.
    assert solo > 2.0 * (sum(crowd) / len(crowd))
    assert 92.7 * 2 * 0.5 < solo < 92.7 * 2 * 1.5


async def test_max_running_requests_queues_the_excess_and_abort_frees_the_slot(emulator: MakeEmu) -> None:
    server = await emulator("baseline", max_running_requests=2, time_scale=1.0)
    body = {**CHAT, "max_tokens": 5000, "ignore_eos": True, "stream": True}
    tasks = [
        asyncio.create_task(sse(server.url + "/v1/chat/completions", {**body, "rid": f"r{i}"}))
        for i in range(3)
    ]
    engine = server.engine
    assert await wait_until(lambda: engine.num_running == 2 and engine.num_queued == 1)
    load = (await get_json(server.url + "/v1/loads"))["loads"][0]
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (2, 1)
    assert not engine.is_active("nope")
    async with aiohttp.ClientSession() as s, s.post(server.url + "/abort_request", json={"rid": "r0"}) as r:
        assert r.status == 200
    status, events = await tasks[0]
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert await wait_until(lambda: engine.num_running == 2 and engine.num_queued == 0)  # r2 got the slot
    async with aiohttp.ClientSession() as s, s.post(server.url + "/abort_request", json={"abort_all": True}):
        pass
    for t in tasks[1:]:
        status, events = await t
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert engine.num_running == 0


async def test_client_disconnect_aborts_and_frees_the_slot_at_once(emulator: MakeEmu) -> None:
    server = await emulator("eagle", max_running_requests=1, time_scale=1.0)
    body = {**CHAT, "max_tokens": 5000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/chat/completions", json=body) as r:
            await r.content.readline()  # the first event: it is running
            assert server.engine.num_running == 1
        # leaving the block closes the connection mid-stream
    assert await wait_until(lambda: server.engine.num_running == 0, timeout_s=5)
    # non-streaming, still queued behind nothing: cancelled while waiting for its answer
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(
            s.post(server.url + "/v1/chat/completions", json={**body, "stream": False})
        )
        assert await wait_until(lambda: server.engine.num_running == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await wait_until(lambda: server.engine.num_running == 0, timeout_s=5)


# -- fault knobs ---------------------------------------------------------------------------


async def test_error_rate_answers_sglang_flat_500(emulator: MakeEmu) -> None:
    server = await emulator("baseline", faults=FaultConfig(error_rate=1.0))
    async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 500
        body = await r.json()
    assert body["object"] == "error" and body["code"] == 500 and "message" in body
    with pytest.raises(openai.InternalServerError):
        await client(server).chat.completions.create(model="x", messages=MESSAGES, max_tokens=2)
    server.faults.error_rate = 0.0  # live knob
    r2 = await client(server).chat.completions.create(model="x", messages=MESSAGES, max_tokens=2)
    assert r2.usage is not None and r2.usage.completion_tokens == 2


async def test_queue_bound_gives_503_or_streamed_error_event(emulator: MakeEmu) -> None:
    server = await emulator(
        "baseline", max_running_requests=1, time_scale=1.0, faults=FaultConfig(max_queued_requests=0)
    )
    long = {**CHAT, "max_tokens": 5000, "ignore_eos": True, "stream": True}
    holder = asyncio.create_task(sse(server.url + "/v1/chat/completions", long))
    assert await wait_until(lambda: server.engine.num_running == 1)
    async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 503
        body = await r.json()
    assert body == {
        "object": "error", "message": "The request queue is full.", "type": "SERVICE_UNAVAILABLE",
        "param": None, "code": 503,
    }  # fmt: skip
    status, events = await sse(server.url + "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200
    assert events == [{"error": body}, "[DONE]"]
    server.engine.abort_all()
    await holder


async def test_stall_delays_the_first_byte(emulator: MakeEmu) -> None:
    server = await emulator("baseline", time_scale=0.05, faults=FaultConfig(stall_s=0.6))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    r = await client(server).chat.completions.create(model="x", messages=MESSAGES, max_tokens=2)
    assert loop.time() - t0 >= 0.6
    assert r.usage is not None and r.usage.completion_tokens == 2


async def test_die_mid_stream_breaks_the_client_and_frees_the_slot(emulator: MakeEmu) -> None:
    server = await emulator("baseline", faults=FaultConfig(die_after_chunks=3))
    body = {**CHAT, "max_tokens": 50, "ignore_eos": True, "stream": True}
    got: list[bytes] = []
    with pytest.raises(aiohttp.ClientPayloadError):
        async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            async for line in r.content:
                got.append(line)
    assert b"data: [DONE]\n" not in got and any(b'"content":" The"' in g for g in got)
    with pytest.raises(openai.APIError):
        stream = await client(server).chat.completions.create(
            model="x", messages=MESSAGES, max_tokens=50, stream=True
        )
        async for _ in stream:
            pass
    assert await wait_until(lambda: server.engine.num_running == 0)
    with pytest.raises(openai.APIConnectionError):  # non-streaming: the connection drops unanswered
        await client(server).chat.completions.create(model="x", messages=MESSAGES, max_tokens=50)


async def test_refusing_connections(emulator: MakeEmu) -> None:
    server = await emulator("baseline", faults=FaultConfig(refuse_connections=True))
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as s, s.get(server.url + "/health") as r:
            await r.read()
    server.faults.refuse_connections = False
    await get_json(server.url + "/v1/models")
    await server.stop_listening()
    with pytest.raises(aiohttp.ClientConnectorError):
        async with aiohttp.ClientSession() as s, s.get(server.url + "/health"):
            pass
    await server.start_listening()  # same port again
    await get_json(server.url + "/v1/models")


async def test_unhealthy_knob(emulator: MakeEmu) -> None:
    server = await emulator("baseline", faults=FaultConfig(unhealthy=True))
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/ready"):
            async with s.get(server.url + path) as r:
                assert r.status == 503


async def test_bad_input_gets_a_clear_400(emulator: MakeEmu) -> None:
    server = await emulator("baseline")
    url = server.url + "/v1/chat/completions"
    cases: list[tuple[Any, str]] = [
        ({"model": "x"}, "messages"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_tokens": "ten"}, "max_tokens"),
        ({**CHAT, "messages": []}, "Messages cannot be empty."),
        ({**CHAT, "model": "base:adapter"}, "LoRA"),
        ([1, 2], "JSON object"),
    ]
    async with aiohttp.ClientSession() as s:
        for body, needle in cases:
            async with s.post(url, json=body) as r:
                assert r.status == 400, body
                err = await r.json()
                assert err["object"] == "error" and err["code"] == 400 and needle in err["message"]
        async with s.post(url, data=b"{nope", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
        for empty in ("", [], ["", ""]):  # serving_completions._validate_request
            async with s.post(server.url + "/v1/completions", json={"prompt": empty}) as r:
                assert r.status == 400 and (await r.json())["message"] == "Prompt cannot be empty"
        async with s.post(server.url + "/v1/completions", json={"prompt": {"a": 1}}) as r:
            assert r.status == 400
        too_long = {"prompt": list(range(server.emulator.config.max_model_len))}
        async with s.post(server.url + "/v1/completions", json=too_long) as r:
            assert r.status == 400 and "context length" in (await r.json())["message"]
        # SGLang refuses prompt + max_tokens beyond the context rather than cutting the answer short
        over = {**CHAT, "max_tokens": server.emulator.config.max_model_len}
        async with s.post(url, json=over) as r:
            assert r.status == 400
            assert "exceeds the model's maximum context length" in (await r.json())["message"]


async def test_api_key(emulator: MakeEmu) -> None:
    server = await emulator("baseline", api_key="sekret")
    with pytest.raises(openai.AuthenticationError):
        await client(server).chat.completions.create(model="x", messages=MESSAGES, max_tokens=2)
    ok = client(server, api_key="sekret")
    r = await ok.chat.completions.create(model="x", messages=MESSAGES, max_tokens=2)
    assert r.usage is not None and r.usage.completion_tokens == 2
    async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as resp:
        assert resp.status == 200


async def test_hint_factor_raises_tokens_per_chunk(emulator: MakeEmu) -> None:
    server = await emulator("eagle", hint_factors={"code": 1.5, "prose": 0.5}, time_scale=0.05)
    body = {**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def chunks(hint: str) -> int:
        _, events = await sse(server.url + "/v1/chat/completions", body, headers={"x-specroute-hint": hint})
        return sum(
            1
            for e in events
            if isinstance(e, dict) and e["choices"] and e["choices"][0]["delta"].get("content")
        )

    code, prose = await chunks("code"), await chunks("prose")
    # means 3.6 vs 1.2 tokens per verify step
    assert code < 0.6 * prose


def test_config_errors_are_clear() -> None:
    no_accept = KIMI.model_copy(
        update={"modes": {"eagle": KIMI.modes["eagle"].model_copy(update={"accept_length": None})}}
    )
    with pytest.raises(ValueError, match="accept_length"):
        EmulatorConfig(mode="eagle", profile=no_accept)
    only_eagle = KIMI.model_copy(update={"modes": {"eagle": KIMI.modes["eagle"]}})
    with pytest.raises(ValueError, match="no 'baseline' mode"):
        EmulatorConfig(mode="baseline", profile=only_eagle)
    with pytest.raises(ValueError, match="time_scale"):
        EmulatorConfig(mode="baseline", profile=KIMI, time_scale=0)
    # a verify step accepts at most num_steps + 1 tokens; more would silently slow the server down
    with pytest.raises(ValueError, match="raise speculative_num_steps"):
        EmulatorConfig(mode="eagle", profile=KIMI, accept_length=4.5)
    assert EmulatorConfig(mode="eagle", profile=KIMI, accept_length=4.5, speculative_num_steps=4)


# -- the command ---------------------------------------------------------------------------


async def test_emulate_command_prints_its_url_and_stops_on_sigterm() -> None:
    import signal

    proc, line = await start_module(
        "controller.cli", "emulate", "--mode", "eagle", "--port", "0", "--time-scale", "0.1",
        "--hint-factor", "code=1.2",
    )  # fmt: skip
    try:
        assert line.startswith("emulator (eagle) listening on http://127.0.0.1:"), line
        url = line.rsplit(" ", 1)[1]
        info = await get_json(url + "/server_info")
        assert info["speculative_algorithm"] == "EAGLE3"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    code, _, err = await run_specroute("emulate", "--mode", "eagle", "--profile", "nope", timeout_s=30)
    assert code == 2 and "no built-in profile 'nope'" in err and "Traceback" not in err
    for port in ("-1", "65536"):
        code, _, err = await run_specroute("emulate", "--mode", "baseline", "--port", port, timeout_s=30)
        assert code == 2 and "expected a port number 0..65535" in err and "Traceback" not in err


async def test_spec_tokens_details_chunk_before_usage(emulator: MakeEmu) -> None:
    server = await emulator("eagle")
    body = {
        **CHAT, "max_tokens": 60, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, "return_spec_tokens_details": True,
    }  # fmt: skip
    _, events = await sse(server.url + "/v1/chat/completions", body)
    *_, details, usage, done = events
    d = details["sglext"]["spec_tokens_details"]
    assert details["choices"] == [] and usage["usage"]["completion_tokens"] == 60 and done == "[DONE]"
    # the first token comes from prefill; every other token from a verify step
    assert d["spec_num_correct_drafts"] + d["spec_verify_ct"] == 59
    assert d["spec_num_proposed_drafts"] == 3 * d["spec_verify_ct"]
    # SGLang's formula (tokenizer_manager._calculate_spec_decoding_metrics): completion tokens,
    # the prefill's one included, per verify step
    assert d["spec_accept_length"] == pytest.approx(60 / d["spec_verify_ct"])
    assert d["spec_accept_rate"] == pytest.approx(
        d["spec_num_correct_drafts"] / d["spec_num_proposed_drafts"]
    )
    async with (
        aiohttp.ClientSession() as s,
        s.post(server.url + "/v1/chat/completions", json={**body, "stream": False}) as r,
    ):
        assert "spec_tokens_details" in (await r.json())["sglext"]
    # only when asked, and only from a speculative server (SGLang has no stats to report otherwise)
    _, events = await sse(server.url + "/v1/chat/completions", {**body, "return_spec_tokens_details": False})
    assert not any("sglext" in e for e in events if isinstance(e, dict))
    plain = await emulator("baseline")
    _, events = await sse(plain.url + "/v1/chat/completions", body)
    assert not any("sglext" in e for e in events if isinstance(e, dict)) and events[-1] == "[DONE]"
