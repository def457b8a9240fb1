"""The emulator's native `/generate`, `n > 1`, logprobs, and streams that survive a paused process.

Shapes are SGLang 0.5.23's (io_struct GenerateReqInput, tokenizer_manager `_handle_batch_output`,
http_server `generate_request`); requests use the bodies SGLang's serving benchmark sends
(`sglang_bench`). Real HTTP on 127.0.0.1:0; the pause test runs `specroute emulate` as a child
process and stops it with SIGSTOP."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from helpers import ROOT, start_module
from openai.types.chat import ChatCompletionMessageParam
from sglang_bench import chat_body, completions_body, generate_body, read_generate_stream

from simulator.emulator import synthetic
from simulator.emulator.app import EmulatorServer, FaultConfig

MakeEmu = Callable[..., Awaitable[EmulatorServer]]
META_KEYS = {
    "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens",
    "completion_tokens", "cached_tokens",
}  # fmt: skip
SPEC_KEYS = {"spec_accept_rate", "spec_accept_length", "spec_num_correct_drafts", "spec_num_proposed_drafts"}
SPEC_KEYS |= {"spec_verify_ct"}


@pytest.fixture
def emulator_time_scale() -> float:
    return 0.2


async def post_json(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


async def sse_events(url: str, body: Any) -> tuple[int, list[Any]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        text = await r.text()
    events: list[Any] = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return r.status, events


# -- /generate ------------------------------------------------------------------------------------


async def test_generate_non_streaming_answers_text_ids_and_meta_info(emulator: MakeEmu) -> None:
    server = await emulator("baseline")
    status, out = await post_json(server.url + "/generate", generate_body("Paris is", 17, stream=False))
    assert status == 200
    assert list(out) == ["text", "output_ids", "meta_info"]
    assert out["text"] == synthetic.text(0, 17) and out["output_ids"] == synthetic.token_ids(0, 17)
    meta = out["meta_info"]
    assert META_KEYS | {"e2e_latency"} == set(meta)
    assert meta["completion_tokens"] == 17 and meta["prompt_tokens"] == 2
    assert meta["finish_reason"] == {"type": "length", "length": 17}
    assert len(meta["id"]) == 32 and meta["e2e_latency"] > 0
    # input_ids instead of text; no max_new_tokens: SGLang's default of 128
    body = {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"ignore_eos": True}}
    status, out = await post_json(server.url + "/generate", body)
    assert status == 200
    assert out["meta_info"]["prompt_tokens"] == 5 and out["meta_info"]["completion_tokens"] == 128


async def test_generate_stream_is_cumulative_with_counts_in_meta_info(emulator: MakeEmu) -> None:
    server = await emulator("eagle")
    async with aiohttp.ClientSession() as s:
        got = await read_generate_stream(s, server.url + "/generate", generate_body("Write a poem.", 60))
    assert got.status == 200 and got.done and got.headers["Content-Type"].startswith("text/event-stream")
    outputs = [e for e in got.events if isinstance(e, dict)]
    texts = [o["text"] for o in outputs]
    assert all(a == b[: len(a)] for a, b in itertools.pairwise(texts))  # each extends the last
    counts = [o["meta_info"]["completion_tokens"] for o in outputs]
    assert counts == sorted(counts) and all(
        len(o["output_ids"]) == o["meta_info"]["completion_tokens"] for o in outputs
    )
    assert got.output_len == 60 and got.text == synthetic.text(0, 60)
    assert got.chunks_with_text < 60  # one output per verify step: several tokens each
    assert "response_sent_to_client_ts" in outputs[0]["meta_info"]
    assert all(o["meta_info"]["finish_reason"] is None for o in outputs[:-1])
    last = got.last["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 60}
    assert SPEC_KEYS <= set(last) and last["spec_accept_length"] == pytest.approx(60 / last["spec_verify_ct"])
    assert last["spec_num_proposed_drafts"] == 3 * last["spec_verify_ct"]


async def test_generate_stops_at_eos_without_ignore_eos(emulator: MakeEmu) -> None:
    server = await emulator("baseline", output_tokens_mean=9, output_tokens_cv=0.0)
    status, out = await post_json(server.url + "/generate", {"text": "Hi", "sampling_params": {}})
    assert status == 200
    eos = server.emulator.config.eos_token_id
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert out["meta_info"]["completion_tokens"] == 9


async def test_generate_batch_and_parallel_samples(emulator: MakeEmu) -> None:
    server = await emulator("baseline")
    body: dict[str, Any] = {
        "text": ["one", "two two two two"],
        "sampling_params": {"max_new_tokens": 5, "n": 2},
    }
    status, outs = await post_json(server.url + "/generate", body)
    assert status == 200 and isinstance(outs, list) and len(outs) == 4
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [1, 1, 4, 4]  # prompt by prompt
    assert len({o["meta_info"]["id"] for o in outs}) == 4
    assert all(o["meta_info"]["completion_tokens"] == 5 and "index" not in o for o in outs)
    status, events = await sse_events(server.url + "/generate", {**body, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    last: dict[int, dict[str, Any]] = {}
    for e in events[:-1]:
        last[e["index"]] = e
    assert sorted(last) == [0, 1, 2, 3]
    assert all(
        e["meta_info"]["completion_tokens"] == 5 and e["meta_info"]["finish_reason"] for e in last.values()
    )
    # a batch of input_ids without n: ids rid_0, rid_1
    body = {"input_ids": [[1, 2], [3]], "rid": "job", "sampling_params": {"max_new_tokens": 2}}
    status, outs = await post_json(server.url + "/generate", body)
    assert status == 200 and [o["meta_info"]["id"] for o in outs] == ["job_0", "job_1"]


async def test_generate_logprobs(emulator: MakeEmu) -> None:
    server = await emulator("baseline")
    body = {
        **generate_body("four token prompt", 6, stream=False),
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
        "logprob_start_len": 0,
    }
    status, out = await post_json(server.url + "/generate", body)
    assert status == 200
    meta = out["meta_info"]
    assert meta["output_token_logprobs_length"] == 6
    outputs = meta["output_token_logprobs"]
    assert [t for _, t, _ in outputs] == out["output_ids"]
    assert "".join(text for _, _, text in outputs) == out["text"]
    assert all(lp < 0 for lp, _, _ in outputs)
    assert [len(row) for row in meta["output_top_logprobs"]] == [2] * 6
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] == 5
    assert meta["input_token_logprobs"][0][0] is None  # the first prompt token has no logprob
    # SGLang's benchmark default (logprob_start_len -1, no text): no input logprobs, null texts
    plain = {**body, "logprob_start_len": -1, "top_logprobs_num": 0, "return_text_in_logprobs": False}
    status, out = await post_json(server.url + "/generate", plain)
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == [] and "output_top_logprobs" not in meta
    assert all(text is None for _, _, text in meta["output_token_logprobs"])


async def test_generate_errors_have_sglang_shapes(emulator: MakeEmu) -> None:
    server = await emulator("baseline", max_model_len=1000)
    url = server.url + "/generate"
    # the JSON contract: 400 {"error": "<text>"}
    for body in ([1, 2], {"text": 5}, {"text": "x", "sampling_params": "hot"}, {"text": "x", "stream": "yes"},
                 {"text": "x", "sampling_params": {"max_new_tokens": "many"}}):  # fmt: skip
        status, out = await post_json(url, body)
        assert status == 400 and isinstance(out["error"], str) and out["error"], body
    # SGLang's ValueErrors: 400 {"error": {"message": ...}}, or an error event when streaming
    cases: list[tuple[dict[str, Any], str]] = [
        ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": []}, "input_ids cannot be empty."),
        (
            {"input_ids": list(range(1000))},
            "The input (1000 tokens) is longer than the model's context length",
        ),
        (
            {"text": "x", "sampling_params": {"max_new_tokens": 1000}},
            "exceeds the model's maximum context length",
        ),
    ]
    for body, needle in cases:
        status, out = await post_json(url, body)
        assert status == 400 and needle in out["error"]["message"], (body, out)
        status, events = await sse_events(url, {**body, "stream": True})
        assert status == 200 and events[-1] == "[DONE]" and len(events) == 2
        err = events[0]["error"]
        assert needle in err["message"] and err["code"] == 400 and err["type"] == "invalid_request_error"
    async with aiohttp.ClientSession() as s, s.post(url, data=b"{nope") as r:
        assert r.status == 400 and (await r.json())["object"] == "error"


async def test_generate_queue_full(emulator: MakeEmu) -> None:
    server = await emulator("baseline", max_running_requests=1, time_scale=1.0,
                            faults=FaultConfig(max_queued_requests=0))  # fmt: skip
    holder = asyncio.create_task(post_json(server.url + "/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": 5000, "ignore_eos": True}}))  # fmt: skip
    try:
        for _ in range(200):
            if server.engine.num_running == 1:
                break
            await asyncio.sleep(0.02)
        status, out = await post_json(server.url + "/generate", generate_body("y", 4, stream=False))
        assert status == 503
        message = "The request queue is full."
        assert out == {"object": "error", "message": message, "type": "503", "param": None, "code": 503}
        status, events = await sse_events(server.url + "/generate", generate_body("y", 4))
        assert status == 200 and len(events) == 2 and events[1] == "[DONE]"
        reason = events[0]["meta_info"]["finish_reason"]
        assert reason == {"type": "abort", "status_code": 503, "message": "The request queue is full."}
    finally:
        server.engine.abort_all()
        await holder


# -- n > 1 and logprobs on the OpenAI routes ------------------------------------------------------


async def test_chat_n_samples_stream_and_not(emulator: MakeEmu) -> None:
    server = await emulator("baseline")
    body = {**chat_body("m", "Hello there", 7), "n": 3, "stream": False}
    status, out = await post_json(server.url + "/v1/chat/completions", body)
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == synthetic.text(0, 7) for c in out["choices"])
    usage = out["usage"]
    assert usage["completion_tokens"] == 21 and usage["total_tokens"] == usage["prompt_tokens"] + 21
    status, events = await sse_events(
        server.url + "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert status == 200 and events[-1] == "[DONE]"
    *chunks, usage_chunk, _ = events
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 21
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role") == "assistant"]
    finishes = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(roles) == [0, 1, 2] and sorted(f["index"] for f in finishes) == [0, 1, 2]
    assert chunks[-3:] == [c for c in chunks if c["choices"][0]["finish_reason"]]  # finish chunks come last
    for i in range(3):
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"][0]["index"] == i
        )
        assert text == synthetic.text(0, 7)
    # every sample has its own id on its own chunks
    assert len({c["id"] for c in chunks if c["choices"][0]["delta"].get("role")}) == 3


async def test_completions_batch_of_prompts_with_n(emulator: MakeEmu) -> None:
    server = await emulator("baseline")
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    async with client:
        r = await client.completions.create(
            model="m", prompt=["a b c d", "e"], n=2, max_tokens=3, extra_body={"ignore_eos": True}
        )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text == synthetic.text(0, 3) and c.finish_reason == "length" for c in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 2 + 1


async def test_logprobs_shapes_through_the_openai_client(emulator: MakeEmu) -> None:
    server = await emulator("eagle")
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    async with client:
        hi: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        chat = await client.chat.completions.create(
            model="m",
            messages=hi,
            max_tokens=9,
            logprobs=True,
            top_logprobs=3,
            extra_body={"ignore_eos": True},
        )
        lp = chat.choices[0].logprobs
        assert lp is not None and lp.content is not None and len(lp.content) == 9
        assert "".join(t.token for t in lp.content) == chat.choices[0].message.content
        assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in lp.content)
        assert all(bytes(t.bytes or []) == t.token.encode() for t in lp.content)
        stream = await client.chat.completions.create(
            model="m", messages=hi, max_tokens=30, logprobs=True, stream=True, extra_body={"ignore_eos": True}
        )
        streamed: list[str] = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                assert chunk.choices[0].delta.content == "".join(
                    t.token for t in chunk.choices[0].logprobs.content
                )
                streamed += [t.token for t in chunk.choices[0].logprobs.content]
        assert len(streamed) == 30
        comp = await client.completions.create(
            model="m", prompt="hi", max_tokens=5, logprobs=2, extra_body={"ignore_eos": True}
        )
        clp = comp.choices[0].logprobs
        assert clp is not None and clp.tokens is not None and len(clp.tokens) == 5
        assert "".join(clp.tokens) == comp.choices[0].text
        assert clp.top_logprobs is not None and all(len(d) == 2 for d in clp.top_logprobs)
        assert clp.text_offset == [-1] * 5  # as SGLang: not supported yet
    bad = {**chat_body("m", "hi", 3), "stream": False, "logprobs": "yes"}
    status, out = await post_json(server.url + "/v1/chat/completions", bad)
    assert status == 400 and "logprobs" in out["message"]


# -- a paused process ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def emulate_process(mode: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    proc, line = await start_module(
        "controller.cli", "emulate", "--mode", mode, "--port", "0", "--time-scale", "0.5"
    )
    try:
        assert "listening on" in line, line
        yield proc, line.rsplit(" ", 1)[1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)


async def _openai_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[str, int, bool]:
    """(text, usage completion tokens, ended with [DONE]) of a streamed OpenAI-route answer."""
    text, tokens, done = "", -1, False
    async with session.post(url, json={**body, "stream_options": {"include_usage": True}}) as r:
        assert r.status == 200
        async for raw in r.content:
            line = raw.strip()
            if not line:
                continue
            if line == b"data: [DONE]":
                done = True
                continue
            event = json.loads(line.removeprefix(b"data: "))
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for c in event["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text, tokens, done


@pytest.mark.parametrize("mode", ["baseline", "eagle"])
async def test_streams_survive_sigstop_of_the_emulator(mode: str) -> None:
    """SIGSTOP for 100 ms, SIGCONT, repeatedly, while completions, chat and /generate stream 200
    tokens each: every stream completes with all its tokens (the engine catches up by running the
    overdue steps at once; the handlers take every queued event, as SGLang does)."""
    async with emulate_process(mode) as (proc, url):
        assert proc.stderr is not None
        async with aiohttp.ClientSession() as s:
            streams: list[asyncio.Task[Any]] = [
                asyncio.create_task(
                    _openai_stream(s, url + "/v1/completions", completions_body("m", "hi", 200))
                ),
                asyncio.create_task(
                    _openai_stream(s, url + "/v1/chat/completions", chat_body("m", "hi", 200))
                ),
                asyncio.create_task(read_generate_stream(s, url + "/generate", generate_body("hi", 200))),
            ]
            pauses = 0
            while not all(t.done() for t in streams) and pauses < 8:
                await asyncio.sleep(0.1)
                proc.send_signal(signal.SIGSTOP)
                await asyncio.sleep(0.1)
                proc.send_signal(signal.SIGCONT)
                pauses += 1
            (c_text, c_tokens, c_done), (h_text, h_tokens, h_done), native = await asyncio.wait_for(
                asyncio.gather(*streams), 60
            )
    assert pauses >= 2, "the streams ended before the process was paused twice"
    expected = synthetic.text(0, 200)
    assert (c_done, c_tokens, c_text) == (True, 200, expected)
    assert (h_done, h_tokens, h_text) == (True, 200, expected)
    assert native.done and native.output_len == 200 and native.text == expected
    err = (await proc.stderr.read()).decode()
    assert "Traceback" not in err and "Error" not in err, err[-2000:]


def test_emulator_gaps_are_listed_in_the_docs() -> None:
    """docs/sglang.md tells users what the emulator does not do (kept in step with http.py's note)."""
    page = (ROOT / "docs" / "sglang.md").read_text(encoding="utf-8")
    section = page.split("## What the emulator does not do", 1)[1].split("\n## ", 1)[0]
    for gap in ("tool", "echo", "max_tokens: 0", "cached_tokens", "synthetic"):
        assert gap in section, gap
