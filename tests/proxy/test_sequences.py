"""Issue 37, finding 2 (the validation half): `n` and lists of prompts put many sequences on a
backend in one request (`n: 300` on chat and 300 prompts on /v1/completions put 300 sequences on a
backend whose cap is 48 while specroute counted one request). A request is now counted as the
sequences it runs (`validate.sequences`, the one count admission and the decode rate divide by)
and refused with an OpenAI-shaped 400 above `max_n` / `max_prompts_per_request`, before a backend
is reserved for it."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from helpers import assert_openai_error

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
