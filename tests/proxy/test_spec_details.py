"""`spec_details`: the proxy asks eagle backends for SGLang's per-request speculative stats on the
client's behalf, feeds the accept length to the policy, and hands the client exactly the bytes it
would have got without asking -- streaming or not, with or without the usage chunk."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import FRANCE, post_bytes

from controller.proxy.spec_details import SpecEvents, accept_length, drop_sglext_member

CHAT = FRANCE
CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "m", "messages": CHAT}),
    ("/v1/completions", {"model": "m", "prompt": "The capital of France is"}),
]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("usage", [True, False])
async def test_asked_on_eagle_and_stripped_byte_for_byte(
    fake_backend, proxy, stream: bool, usage: bool
) -> None:  # type: ignore[no-untyped-def]
    eagle = await fake_backend(chunks=5, speculative=True)
    base = await fake_backend(chunks=5, speculative=True)
    p = await proxy(
        baseline=[base.url],
        eagle=[eagle.url],
        policy="fixed",
        policy_params={"pool": "eagle"},
        spec_details=True,
        allow_client_override=True,
    )
    for path, body in CASES:
        body = {**body, "stream": stream}
        if usage and stream:
            body["stream_options"] = {"include_usage": True}
        direct = await post_bytes(eagle.url, path, body)
        assert b"sglext" not in direct
        proxied = await post_bytes(p.url, path, body)
        assert proxied == direct
        assert eagle.requests[-1]["return_spec_tokens_details"] is True  # asked for, on the client's behalf
        record = p.records[-1]
        # 5 tokens: the first from prefill, 4 over 2 verify steps; SGLang's figure is 5 / 2
        assert record.outcome.accept_length == pytest.approx(2.5)
        assert record.outcome.completion_tokens == 5
    # a baseline backend is never asked (a plain server has no speculative stats)
    body = {"model": "m", "messages": CHAT, "stream": stream}
    assert await post_bytes(p.url, "/v1/chat/completions", body, {"x-specroute-mode": "baseline"})
    assert "return_spec_tokens_details" not in base.requests[-1]
    assert p.records[-1].outcome.accept_length is None


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_asks_gets_the_details_untouched(fake_backend, proxy, stream: bool) -> None:  # type: ignore[no-untyped-def]
    eagle = await fake_backend(chunks=5, speculative=True)
    p = await proxy(eagle=[eagle.url], policy="fixed", policy_params={"pool": "eagle"}, spec_details=True)
    # (with its own rid: the fake's ids otherwise hash the client's bytes, which end like specroute's ask)
    body = {"model": "m", "messages": CHAT, "stream": stream, "return_spec_tokens_details": True, "rid": "r1"}
    direct = await post_bytes(eagle.url, "/v1/chat/completions", body)
    assert b'"spec_tokens_details"' in direct
    assert await post_bytes(p.url, "/v1/chat/completions", body) == direct
    assert p.records[-1].outcome.accept_length == pytest.approx(2.5)


async def test_off_by_default(fake_backend, proxy) -> None:  # type: ignore[no-untyped-def]
    eagle = await fake_backend(chunks=5, speculative=True)
    p = await proxy(eagle=[eagle.url], policy="fixed", policy_params={"pool": "eagle"})
    body = {"model": "m", "messages": CHAT, "stream": True}
    assert await post_bytes(p.url, "/v1/chat/completions", body) == await post_bytes(
        eagle.url, "/v1/chat/completions", body
    )
    assert "return_spec_tokens_details" not in eagle.requests[-1]
    assert p.records[-1].outcome.accept_length is None


def test_removing_the_member_keeps_every_other_byte() -> None:
    details = b'{"spec_verify_ct": 3, "spec_accept_length": 2.5, "histogram": [1, {"x": "}"}]}'
    for before, after in (
        (b'{"id": "a", "usage": {"n": 1}', b"}"),  # last member, spaced
        (b'{"id":"a","usage":{"n":1}', b"}"),  # last member, compact
        (b"{", b', "id": "a"}'),  # first member
        (b'{"id": "a \\"sglext\\"", "choices": [{"sglext": 1}]', b', "z": null}'),  # in the middle
    ):
        joiner = b", " if before != b"{" else b""
        body = before + joiner + b'"sglext": {"spec_tokens_details": ' + details + b"}" + after
        stripped, found = drop_sglext_member(body)
        expected = before + (after if before != b"{" else after[2:])
        assert stripped == expected and found is not None and found["spec_verify_ct"] == 3
    # other extensions (asked for by the client) stay, and so does anything unparseable
    keep = b'{"id": "a", "sglext": {"routed_experts": "x", "spec_tokens_details": {}}}'
    assert drop_sglext_member(keep) == (keep, None)
    assert drop_sglext_member(b'{"sglext": {"spec_tokens_details": ') == (
        b'{"sglext": {"spec_tokens_details": ',
        None,
    )
    assert drop_sglext_member(b"\xff\xfe sglext") == (b"\xff\xfe sglext", None)


def test_the_details_event_goes_and_everything_else_stays() -> None:
    event = b'data: {"id":"r","choices":[],"sglext":{"spec_tokens_details":{"spec_verify_ct":4}}}\n\n'
    usage = b'data: {"id":"r","choices":[],"usage":{"completion_tokens":9}}\n\n'
    content = b'data: {"id":"r","choices":[{"delta":{"content":"\\"sglext\\""}}]}\n\n'
    found = SpecEvents(strip=True)
    assert found.strip(content + event + usage + b"data: [DONE]\n\n") == content + usage + b"data: [DONE]\n\n"
    assert found.details == {"spec_verify_ct": 4} and accept_length(found.details, 9) == pytest.approx(2.25)
    kept = SpecEvents(strip=False)
    assert kept.strip(event + usage) == event + usage and kept.details == {"spec_verify_ct": 4}
    # without a verify count the reported accept length is used; nonsense gives None
    assert accept_length({"spec_accept_length": 3.0}, None) == 3.0
    assert accept_length({"spec_verify_ct": 0, "spec_accept_length": "x"}, 5) is None
    assert accept_length(None, 5) is None
