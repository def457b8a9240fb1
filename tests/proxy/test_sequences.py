"""Issue 37, finding 2: `n` and lists of prompts put many sequences on a backend in one request
(`n: 300` on chat and 300 prompts on /v1/completions put 300 sequences on a backend whose cap is
48 while specroute counted one request, the other clients timed out, and the learned decode rate
was n times too high). A request is now counted as the sequences it runs (`validate.sequences`):
refused with an OpenAI-shaped 400 above `max_n` / `max_prompts_per_request`, or above every
bound it may use, before a backend is reserved for it; admitted as that many slots (others get
a 429 when none is left, never a timeout); and its decode rate is per sequence."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import aiohttp
import openai
import pytest
from fakes import ShiftedClock
from helpers import assert_openai_error, wait_until

from controller.proxy.errors import BadRequest
from controller.proxy.validate import check_sequences, sequences

CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("endpoint", "body", "count"),
    [
        ("chat", {"messages": CHAT}, 1),
        ("chat", {"messages": CHAT, "n": None}, 1),
        ("chat", {"messages": CHAT, "n": 7}, 7),
        ("completions", {"prompt": "x"}, 1),
        ("completions", {"prompt": [1, 2, 3]}, 1),  # one prompt of token ids
        ("completions", {"prompt": ["a", "b", "c"]}, 3),
        ("completions", {"prompt": [[1, 2], [3]], "n": 4}, 8),
        ("completions", {"prompt": ["a", "b"], "n": 3.0}, 6),
        ("generate", {"text": "x"}, 1),
        ("generate", {"text": "x", "sampling_params": {"n": 5}}, 5),
        ("generate", {"text": ["a", "b"], "sampling_params": {"n": 2}}, 4),  # a batch (refused elsewhere)
        ("generate", {"input_ids": [[1], [2], [3]]}, 3),
        ("generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, 5),
    ],
)
def test_sequences_are_prompts_times_n(endpoint: Any, body: dict[str, Any], count: int) -> None:
    assert sequences(body, endpoint) == count


def test_check_sequences_refuses_above_the_settings_and_names_the_field() -> None:
    assert check_sequences({"messages": CHAT, "n": 16}, "chat", 16, 16) == 16
    assert check_sequences({"prompt": ["a"] * 16}, "completions", 16, 16) == 16
    assert check_sequences({"prompt": ["a"] * 4, "n": 4}, "completions", 16, 16) == 16
    cases: list[tuple[Any, dict[str, Any], str, str]] = [
        ("chat", {"messages": CHAT, "n": 17}, "n", "max_n"),
        ("completions", {"prompt": ["a"] * 17}, "prompt", "max_prompts_per_request"),
        ("completions", {"prompt": ["a"] * 5, "n": 4}, "n", "the larger of max_n and"),
        ("generate", {"text": "x", "sampling_params": {"n": 300}}, "sampling_params.n", "max_n"),
    ]
    for endpoint, body, param, setting in cases:
        with pytest.raises(BadRequest) as e:
            check_sequences(body, endpoint, 16, 16)
        assert e.value.param == param and setting in e.value.message


async def test_n_300_and_300_prompts_are_refused_before_a_backend_is_reserved(fake_backend, proxy) -> None:
    """The probe's attack on 127.0.0.1 through the official client: refused with a 400 naming the
    setting, nothing reaches the backend, nothing is held; requests within the settings pass."""
    fb = await fake_backend(chunks=2)
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False)
    client = p.client()
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="m", messages=CHAT, n=300, max_tokens=2)  # type: ignore[arg-type]
    assert_openai_error({"error": e.value.body}, "invalid_request")
    assert "max_n" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model="m", prompt=[f"p{i}" for i in range(300)], max_tokens=2)
    assert "max_prompts_per_request" in e.value.message
    assert fb.requests == [] and p.tracker.total_in_flight == 0
    assert p.sample("specroute_rejected_requests_total", code="400") == 2.0
    out = await client.chat.completions.create(model="m", messages=CHAT, n=4, max_tokens=2)  # type: ignore[arg-type]
    assert out.choices
    await client.completions.create(model="m", prompt=["a", "b", "c", "d"], max_tokens=2)
    assert [b.get("n") for b in fb.requests] == [4, None]
    await client.close()


async def test_the_settings_raise_the_bounds(fake_backend, proxy) -> None:
    fb = await fake_backend(chunks=2)
    p = await proxy(
        baseline=[fb.url], policy="fixed", health_checks=False, max_n=64, max_prompts_per_request=2
    )
    async with aiohttp.ClientSession() as s:
        body = {"model": "m", "messages": CHAT, "n": 64, "max_tokens": 2}
        async with s.post(p.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
        body = {"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 2}
        async with s.post(p.url + "/v1/completions", json=body) as r:
            assert r.status == 400
            assert_openai_error(await r.json(), "invalid_request")
    assert len(fb.requests) == 1


# --- the reservation half: a request holds one slot per sequence -------------------------------


async def test_n_and_prompt_lists_are_admitted_as_the_sequences_they_run(fake_backend, proxy) -> None:
    """The probe's attack with the settings raised to allow it (max_n and max_prompts_per_request
    300) against backends bounded at 8 sequences each: `n: 300` and 300 prompts can never run
    within a bound, so they get a 400 at once; a chat request with `n: 8` and a completions
    request of 8 prompts hold 8 slots each, so the backends never run more than their bound;
    while they do, a further such request and another client's plain request wait in specroute
    and get a clear 429 after `admission_wait_s` (on the proxy's clock) instead of a timeout, and
    the other client is served once the attacker is gone."""
    base = await fake_backend(name="base")
    spec = await fake_backend(name="spec")
    clock = ShiftedClock()
    p = await proxy(
        baseline=[base.url], eagle=[spec.url], policy="fixed", policy_params={"pool": "baseline"},
        baseline_backend_max_in_flight=8, eagle_backend_max_in_flight=8, max_n=300,
        max_prompts_per_request=300, admission_wait_s=5, health_checks=False, clock=clock,
    )  # fmt: skip
    client = p.client()
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="m", messages=CHAT, n=300, max_tokens=2)  # type: ignore[arg-type]
    assert "300 sequences" in e.value.message and "at most 8 at once" in e.value.message
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="m", prompt=[f"p{i}" for i in range(300)], max_tokens=2)
    assert base.requests == spec.requests == [] and p.tracker.total_in_flight == 0

    async def attack(s: aiohttp.ClientSession, prompts: bool = False) -> int:
        body: dict[str, Any] = {"model": "m", "max_tokens": 2, "fake_mode": "stall"}
        if prompts:
            body["prompt"] = [f"p{i}" for i in range(8)]
        else:
            body |= {"messages": CHAT, "n": 8}
        async with s.post(p.url + ("/v1/completions" if prompts else "/v1/chat/completions"), json=body) as r:
            return r.status

    async def victim() -> None:
        await client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]

    async with aiohttp.ClientSession() as s:
        held = [asyncio.ensure_future(attack(s)), asyncio.ensure_future(attack(s, prompts=True))]
        assert await wait_until(lambda: base.stalled == 1 and spec.stalled == 1, 10)  # baseline full: eagle
        third = asyncio.ensure_future(attack(s))
        other = asyncio.ensure_future(victim())
        assert await wait_until(lambda: p.sample("specroute_admission_waiting_requests") == 2.0, 10)
        assert (base.max_sequences, spec.max_sequences) == (8, 8)
        assert [b.in_flight for b in p.tracker] == [8, 8]
        clock.advance(6)
        assert await asyncio.wait_for(third, 10) == 429
        with pytest.raises(openai.RateLimitError) as limited:
            await asyncio.wait_for(other, 10)
        assert_openai_error({"error": limited.value.body}, "rate_limit_exceeded")
        assert "waited 5 s for a slot" in limited.value.message
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    await p.wait_idle()
    served = await client.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert served.headers["x-specroute-pool"] == "baseline"
    assert (base.max_sequences, spec.max_sequences) == (8, 8) and p.tracker.total_in_flight == 0
    assert base.requests[-1]["messages"] == CHAT  # what the victim asked, after the attacker's
    await client.close()


async def test_the_decode_rate_learned_from_n_sequences_is_per_sequence(fake_backend, proxy) -> None:
    """A streamed request of `n: 8` (and one of 4 prompts x `n: 2`) whose backend decodes for
    `pause_s` seconds of the proxy's clock: the backend reports the 8 sequences' tokens summed, as
    SGLang does, and the outcome a policy learns from has the rate of one sequence (at most
    (tokens - 1) / pause_s), not 8 times it, as a request of `n: 1` in the same run does."""
    tokens, pause_s = 41, 100.0
    base = await fake_backend(name="base", chunks=tokens)
    fb = await fake_backend(name="spec", chunks=tokens, speculative=True)
    fb.fail_after = tokens // 2
    clock = ShiftedClock()
    p = await proxy(
        eagle=[fb.url], baseline=[base.url], policy="fixed", policy_params={"pool": "eagle"},
        health_checks=False, clock=clock, idle_timeout_s=10 * pause_s, client_write_timeout_s=10 * pause_s,
    )  # fmt: skip
    client = p.client()

    async def read(stream: Any) -> list[int]:
        return [c.index async for chunk in stream for c in chunk.choices if c.finish_reason]

    async def paused(create: Any, sequences: int) -> Any:
        stream = await create(extra_body={"fake_mode": "pause_mid"}, stream=True, max_tokens=tokens)
        task = asyncio.ensure_future(read(stream))
        assert await wait_until(lambda: fb.paused == 1, 10)
        clock.advance(pause_s)
        fb.resume.set()
        assert sorted(await asyncio.wait_for(task, 30)) == list(range(sequences))  # every choice ended
        fb.resume.clear()
        await p.wait_idle()
        outcome = p.records[-1].outcome
        assert outcome.status == "ok" and outcome.request.sequences == sequences
        assert outcome.completion_tokens == tokens * sequences
        return outcome.decode_tok_s

    chat = functools.partial(client.chat.completions.create, model="m", messages=CHAT)
    completions = functools.partial(client.completions.create, model="m")
    one = await paused(chat, 1)
    eight = await paused(functools.partial(chat, n=8), 8)
    prompts = await paused(functools.partial(completions, prompt=["a", "b", "c", "d"], n=2), 8)
    for rate in (one, eight, prompts):
        assert rate is not None and (tokens - 1) / (2 * pause_s) < rate <= (tokens - 1) / pause_s
    await client.close()
