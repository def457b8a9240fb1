"""The proxy's prefix tracking: canonical prompt text, the per-backend index updated with the
reservation (and on failover), `cached_tokens` in the view, the backend's report in the outcome
and in metrics; and a live check: emulators with the cache model behind `specroute serve`, a
multi-turn conversation through the official client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from helpers import block_text, cache_profile, make_tracker, replay_conversation

from controller.proxy.prefixes import (
    BLOCK_TOKENS,
    THREAD_FROM_CHARS,
    prompt_blocks,
    prompt_text,
    reported_cached_tokens,
)
from policies.prefix import fingerprint
from simulator.emulator.requests import parse_generate, parse_openai

# -- the canonical text -------------------------------------------------------------------------

BODIES: list[tuple[str, dict[str, Any]]] = [
    (
        "chat",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "ünïcode ✓"},
            ]
        },
    ),
    ("completions", {"prompt": "Once upon a time"}),
    ("completions", {"prompt": [17, 2**20 + 5, 99999]}),
    ("completions", {"prompt": [[1, 2, 3]]}),
    ("generate", {"text": "native prompt"}),
    ("generate", {"input_ids": [5, 6, 7]}),
]


# Both render with `policies.prefix` (checked by hand in tests/test_prefix.py); this checks that
# the proxy picks out the same prompt from a body as the emulator's parser does.
@pytest.mark.parametrize(("endpoint", "body"), BODIES)
def test_the_proxy_renders_prompts_as_the_emulator_caches_them(endpoint: str, body: dict[str, Any]) -> None:
    parsed = parse_generate(body) if endpoint == "generate" else parse_openai(body, endpoint, "m")  # type: ignore[arg-type]
    assert prompt_text(body, endpoint) == parsed.texts[0]  # type: ignore[arg-type]


def test_batches_of_several_prompts_are_not_tracked() -> None:
    assert prompt_text({"prompt": ["a" * 5000, "b" * 5000]}, "completions") == ""
    assert prompt_text({"text": ["a" * 5000, "b" * 5000]}, "generate") == ""


async def test_fingerprints_cover_whole_blocks_and_long_prompts_hash_off_the_loop() -> None:
    short = {"prompt": "x" * 2047}
    assert await prompt_blocks(short, "completions") == ()
    long_text = block_text(THREAD_FROM_CHARS // 2048 + 3, "long")
    blocks = await prompt_blocks({"prompt": long_text}, "completions")  # the worker-thread path
    assert blocks == fingerprint(long_text)
    assert len(blocks) == THREAD_FROM_CHARS // 2048 + 3
    # a large body is rendered in the worker thread too: same blocks, and none for a short prompt
    chat = {"messages": [{"role": "user", "content": long_text}], "pad": "x" * THREAD_FROM_CHARS}
    assert await prompt_blocks(chat, "chat", THREAD_FROM_CHARS + 100) == await prompt_blocks(chat, "chat")
    assert await prompt_blocks(chat, "chat") == fingerprint(prompt_text(chat, "chat"))
    assert await prompt_blocks({**short, "pad": "x" * THREAD_FROM_CHARS}, "completions", 2 << 20) == ()


def test_reported_cached_tokens_reads_usage_and_meta_info_but_not_answer_text() -> None:
    usage = (
        b'data: {"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":7}}}\n\n'
    )
    assert reported_cached_tokens(usage) == 7
    assert reported_cached_tokens(b'{"meta_info":{"cached_tokens": 12}}') == 12
    assert reported_cached_tokens(b'{"usage":{"prompt_tokens_details":null}}') is None
    text = json.dumps({"choices": [{"delta": {"content": '"cached_tokens": 99'}}]}).encode()
    assert reported_cached_tokens(text) is None


# -- the index in the tracker -------------------------------------------------------------------


def test_view_carries_each_backends_matched_prefix_after_reserve_and_move() -> None:
    tracker = make_tracker(["b1=http://127.0.0.1:1", "b2=http://127.0.0.1:2"], ["e1=http://127.0.0.1:3"])
    tracker.track_prefixes({"b1": 100 * BLOCK_TOKENS, "b2": 100 * BLOCK_TOKENS, "e1": 100 * BLOCK_TOKENS})
    system = block_text(3, "system")
    first = fingerprint(system + block_text(2, "alice"))
    second = fingerprint(system + block_text(2, "bob"))

    def cached(blocks: tuple[int, ...]) -> dict[str, int]:
        view = tracker.view(0.0, blocks)
        return {b.name: b.cached_tokens for b in (*view.baseline.backends, *view.eagle.backends)}

    assert cached(first) == {"b1": 0, "b2": 0, "e1": 0}
    r = tracker.reserve("b1", 10, first)
    assert cached(first) == {"b1": 5 * BLOCK_TOKENS, "b2": 0, "e1": 0}
    assert cached(second) == {"b1": 3 * BLOCK_TOKENS, "b2": 0, "e1": 0}  # the shared system prompt
    tracker.move(r, "e1")  # failover: the backend that actually got the prompt learns it
    assert cached(first)["e1"] == 5 * BLOCK_TOKENS
    assert tracker.view(0.0, first, prompt_tokens=100).baseline.backends[0].cached_tokens == 100
    assert tracker.view(0.0)  # no fingerprint: nothing matched
    assert all(b.cached_tokens == 0 for b in tracker.view(0.0).baseline.backends)


def test_the_index_is_bounded_by_the_backends_capacity() -> None:
    tracker = make_tracker(["b1=http://127.0.0.1:1"], [])
    tracker.track_prefixes({"b1": 4 * BLOCK_TOKENS})
    a, b = fingerprint(block_text(3, "alpha")), fingerprint(block_text(3, "beta"))
    tracker.release(tracker.reserve("b1", 0, a))
    tracker.release(tracker.reserve("b1", 0, b))
    (load,) = tracker.view(0.0, a).baseline.backends
    assert load.cached_tokens == 1 * BLOCK_TOKENS  # a's two deepest blocks were evicted for b's


# -- through the proxy --------------------------------------------------------------------------


async def test_the_index_learns_with_the_reservation(emulator: Any, proxy: Any) -> None:
    b1 = await emulator(enable_cache_report=True)
    b2 = await emulator(enable_cache_report=True)
    p = await proxy(baseline=[f"b1={b1.url}", f"b2={b2.url}"], policy="fixed")
    prompt = block_text(6, "shared")
    done = await p.client().completions.create(model="m", prompt=prompt, max_tokens=2)
    (first,) = p.records
    served = first.decision.backend
    believed = {b.name: b.cached_tokens for b in p.tracker.view(0.0, fingerprint(prompt)).baseline.backends}
    assert believed == {"b1": 0, "b2": 0, served: 6 * BLOCK_TOKENS}
    assert [b.cached_tokens for b in first.view.baseline.backends] == [0, 0]  # the view before it
    assert first.outcome.cached_tokens is None  # nothing cached: SGLang sends null
    assert done.usage is not None and done.usage.prompt_tokens_details is None


async def test_streamed_outcomes_carry_the_report_and_null_means_zero_once_reported(
    emulator: Any, proxy: Any
) -> None:
    b1 = await emulator(enable_cache_report=True)
    p = await proxy(baseline=[f"b1={b1.url}"], policy="fixed")
    client = p.client()
    prompt = block_text(5, "streamed")
    for text in (prompt, prompt, "a fresh prompt " * 10):
        stream = await client.completions.create(model="m", prompt=text, max_tokens=2, stream=True)
        async for _ in stream:
            pass
    # first: null, nothing known yet; second: reported; third: null from a reporting backend
    assert [r.outcome.cached_tokens for r in p.records] == [None, 5 * BLOCK_TOKENS - 1, 0]
    assert p.records[1].view.baseline.backends[0].cached_tokens == 5 * BLOCK_TOKENS


async def test_non_streaming_outcomes_and_prefix_metrics(emulator: Any, proxy: Any) -> None:
    b1 = await emulator(enable_cache_report=True)
    p = await proxy(baseline=[f"b1={b1.url}"], policy="fixed")
    client = p.client()
    prompt = block_text(4, "metrics")
    for _ in range(2):
        await client.completions.create(model="m", prompt=prompt, max_tokens=2)
    first, second = p.records
    assert first.outcome.cached_tokens is None and second.outcome.cached_tokens == 4 * BLOCK_TOKENS - 1
    # the index believed all four blocks cached; the backend served all but the last token
    assert p.sample("specroute_prefix_prediction_ratio_count", pool="baseline") == 1
    assert p.sample("specroute_prefix_prediction_ratio_sum", pool="baseline") == pytest.approx(
        4 * BLOCK_TOKENS / (4 * BLOCK_TOKENS - 1)
    )
    assert (
        p.sample("specroute_prefill_tokens_saved_total", pool="baseline", backend="b1")
        == 4 * BLOCK_TOKENS - 1
    )
    assert p.sample("specroute_prompt_tokens_total", pool="baseline", backend="b1") == 4 * BLOCK_TOKENS


async def test_a_flushed_backend_shows_as_a_false_hit(emulator: Any, proxy: Any) -> None:
    b1 = await emulator(enable_cache_report=True)
    p = await proxy(baseline=[f"b1={b1.url}"], policy="fixed")
    prompt = block_text(3, "flushed")
    for _ in range(2):
        await p.client().completions.create(model="m", prompt=prompt, max_tokens=2)
    async with aiohttp.ClientSession() as s, s.post(b1.url + "/flush_cache") as r:
        assert r.status == 200
    await p.client().completions.create(model="m", prompt=prompt, max_tokens=2)
    # the index still believed three blocks cached; the backend reported none (null, now 0)
    assert p.records[-1].outcome.cached_tokens == 0
    assert p.sample("specroute_prefix_false_hits_total", pool="baseline") == 1
    assert p.sample("specroute_prefix_prediction_ratio_count", pool="baseline") == 1


async def test_the_decision_log_has_the_belief_and_the_report(
    emulator: Any, proxy: Any, tmp_path: Path
) -> None:
    b1 = await emulator(enable_cache_report=True)
    log = tmp_path / "decisions.jsonl"
    p = await proxy(baseline=[f"b1={b1.url}"], policy="fixed", decision_log=str(log))
    prompt = block_text(2, "logged")
    for _ in range(2):
        await p.client().completions.create(model="m", prompt=prompt, max_tokens=2)
    await p.stop()  # drains the writer thread
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["believed_cached_tokens"], r["cached_tokens"]) for r in lines] == [
        (0, None),
        (2 * BLOCK_TOKENS, 2 * BLOCK_TOKENS - 1),
    ]


async def test_generate_reports_cached_tokens_without_the_cache_report_flag(
    emulator: Any, proxy: Any
) -> None:
    b1 = await emulator()  # no --enable-cache-report: /generate's meta_info has them anyway
    p = await proxy(baseline=[f"b1={b1.url}"], policy="fixed")

    body = {"text": block_text(3, "native"), "sampling_params": {"max_new_tokens": 2}, "stream": True}
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(p.url + "/generate", json=body) as r:
                assert r.status == 200
                await r.read()
    assert [r.outcome.cached_tokens for r in p.records] == [0, 3 * BLOCK_TOKENS - 1]


async def test_failover_records_the_prompt_on_the_backend_that_served(emulator: Any, proxy: Any) -> None:
    dead = await emulator(enable_cache_report=True)
    alive = await emulator(enable_cache_report=True)
    p = await proxy(
        baseline=[f"dead={dead.url}"], eagle=[f"alive={alive.url}"], policy="fixed", health_checks=False
    )
    dead.faults.refuse_connections = True
    prompt = block_text(2, "failover")
    await p.client().completions.create(model="m", prompt=prompt, max_tokens=2)
    (record,) = p.records
    assert record.chosen.backend == "dead" and record.decision.backend == "alive"
    view = p.tracker.view(0.0, fingerprint(prompt))
    assert view.eagle.backends[0].cached_tokens == 2 * BLOCK_TOKENS


async def test_prefix_tracking_off_leaves_every_backend_uncached(emulator: Any, proxy: Any) -> None:
    b1 = await emulator(enable_cache_report=True)
    p = await proxy(baseline=[f"b1={b1.url}"], policy="fixed", prefix_tracking=False)
    prompt = block_text(3, "blind")
    for _ in range(2):
        await p.client().completions.create(model="m", prompt=prompt, max_tokens=2)
    assert all(b.cached_tokens == 0 for r in p.records for b in r.view.baseline.backends)
    assert p.records[-1].outcome.cached_tokens == 3 * BLOCK_TOKENS - 1  # the backend still caches


# -- live: emulators with the cache model behind `specroute serve` ------------------------------


async def test_live_multi_turn_conversation_hits_the_cache_on_later_turns(
    emulator: Any, spawn_serve: Any, tmp_path: Path
) -> None:
    # 2,000 prompt tokens/s: the first turn's ~6,000-token system prompt costs 3 s of prefill
    # (0.3 s wall at time_scale 0.1); later turns find it cached and prefill only what is new
    profile = cache_profile(prefill_tok_s=2000, cache_tokens=200_000)
    path = tmp_path / "profile.json"
    path.write_text(profile.to_json())
    base = await emulator(profile=profile, time_scale=0.1, enable_cache_report=True)
    eagle = await emulator(mode="eagle", profile=profile, time_scale=0.1, enable_cache_report=True)
    sp = await spawn_serve(
        "--baseline", f"b={base.url}", "--eagle", f"e={eagle.url}", "--profile", str(path),
        "--policy", "fixed", "--policy-param", "pool=baseline",
    )  # fmt: skip
    client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="k", max_retries=0, timeout=60)
    system = block_text(12, "You are a careful assistant.")
    turns = await replay_conversation(client, system, ["first question", "second", "third", "fourth"])
    first, *later = turns
    assert first.cached_tokens == 0
    assert all(t.backend == "b" for t in turns)
    for t in later:
        assert t.cached_tokens > 12 * BLOCK_TOKENS // 2, turns  # at least the system prompt
        assert t.ttft_s < first.ttft_s, turns
    # each turn caches more: the earlier turns and their answers
    assert [t.cached_tokens for t in later] == sorted(t.cached_tokens for t in later)
