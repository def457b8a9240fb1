"""`spec_details`: the proxy asks eagle backends for SGLang's per-request speculative stats on the
client's behalf (and reads vLLM's, which ride on the usage it asks for anyway), feeds the accept
length to the policy, and hands the client exactly the bytes it would have got without asking --
streaming or not, with or without the usage chunk."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import FRANCE, post_bytes

from controller.proxy.spec_details import (
    SpecEvents,
    accept_length,
    drop_sglext_member,
    reported_accept_length,
    vllm_accept_length,
    vllm_speculation,
)

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


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("usage", [True, False])
async def test_vllm_per_request_metrics_read_and_the_answer_unchanged(
    fake_backend, proxy, stream: bool, usage: bool
) -> None:  # type: ignore[no-untyped-def]
    """A vLLM backend started with --per-request-spec-decode-metrics: its figure comes from the
    usage event specroute asked for (dropped again when the client did not ask) or from the
    whole answer's `metrics` (which the client gets directly too)."""
    eagle = await fake_backend(chunks=7, vllm_metrics=True)
    p = await proxy(eagle=[eagle.url], policy="fixed", policy_params={"pool": "eagle"}, spec_details=True)
    for path, body in CASES:
        body = {**body, "stream": stream}
        if usage and stream:
            body["stream_options"] = {"include_usage": True}
        direct = await post_bytes(eagle.url, path, body)
        assert (b'"speculative_decoding"' in direct) == (usage or not stream)
        assert await post_bytes(p.url, path, body) == direct
        # 7 tokens: the first from prefill, then 3 verify steps of one accepted draft and the bonus
        assert p.records[-1].outcome.accept_length == pytest.approx(2.0)
        assert p.records[-1].outcome.completion_tokens == 7
    # spec_details off: nothing read (the policy learns from the decode timing alone)
    off = await proxy(eagle=[eagle.url], policy="fixed", policy_params={"pool": "eagle"})
    body = {"model": "m", "messages": CHAT, "stream": stream}
    assert await post_bytes(off.url, "/v1/chat/completions", body)
    assert off.records[-1].outcome.accept_length is None


def vllm_stats(**fields: object) -> dict[str, object]:
    stats: dict[str, object] = {
        "mean_acceptance_length": 2.5,
        "draft_acceptance_rate": 0.75,
        "acceptance_histogram": [1, 0, 3],
        "num_spec_steps": 4,
        "num_accepted_draft_tokens": 6,
        "num_draft_tokens": 8,
        "num_spec_tokens": 2,
    }
    stats.update(fields)
    return stats


def test_vllm_accept_length_from_its_counts_else_its_mean() -> None:
    assert vllm_accept_length(vllm_stats()) == pytest.approx(2.5)
    # the counts decide when both are there (the mean is rounded in some versions)
    assert vllm_accept_length(vllm_stats(mean_acceptance_length=9.0)) == pytest.approx(2.5)
    assert vllm_accept_length(vllm_stats(num_accepted_draft_tokens=None)) == pytest.approx(2.5)
    assert vllm_accept_length({"mean_acceptance_length": 1.75}) == pytest.approx(1.75)
    # no verify step (a one-token answer): vLLM says 1.0, which is no measurement
    assert vllm_accept_length(vllm_stats(num_spec_steps=0, num_accepted_draft_tokens=0)) is None
    # what no engine reports: None, never a number the policy would learn from
    bad: Any
    for bad in (
        vllm_stats(num_spec_steps=True),
        vllm_stats(num_spec_steps="4", mean_acceptance_length=None),
        vllm_stats(num_accepted_draft_tokens=-1, mean_acceptance_length=0.5),
        vllm_stats(num_accepted_draft_tokens=20),  # 6 per step with k=2
        {"mean_acceptance_length": float("inf")},
        {"mean_acceptance_length": float("nan")},
        {},
        [],
        None,
    ):
        assert vllm_accept_length(bad) is None, bad


def test_vllm_statistics_found_in_a_stream_tail_and_a_whole_answer() -> None:
    stats = vllm_stats()
    usage = {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18}
    chunk = {"id": "c", "choices": [], "usage": usage, "metrics": {"speculative_decoding": stats}}
    text = 'say "speculative_decoding": {"num_spec_steps": 1}'
    content = {"id": "c", "choices": [{"delta": {"content": text}}]}
    for sep in ((",", ":"), (", ", ": ")):
        events = (content, chunk)
        tail = b"".join(b"data: " + json.dumps(e, separators=sep).encode() + b"\n\n" for e in events)
        tail += b"data: [DONE]\n\n"
        assert vllm_speculation(tail) == stats
        assert reported_accept_length(None, 9, tail) == pytest.approx(2.5)
        answer = {"id": "c", "choices": [], "usage": usage, "metrics": {"speculative_decoding": stats}}
        whole = json.dumps(answer, separators=sep).encode()
        assert reported_accept_length(None, 9, whole) == pytest.approx(2.5)
    # an answer whose text names the member (escaped in JSON) is no report
    only_text = b"data: " + json.dumps(content).encode() + b"\n\ndata: [DONE]\n\n"
    assert vllm_speculation(only_text) is None and reported_accept_length(None, 9, only_text) is None
    # SGLang's details come first when there are any
    assert reported_accept_length({"spec_verify_ct": 3}, 9, tail) == pytest.approx(3.0)
    # cut, not an object, too deep, too long, or not JSON: None, never an exception
    for broken in (
        b'{"metrics": {"speculative_decoding": {"num_spec_steps": 4, ',
        b'{"metrics": {"speculative_decoding": null}}',
        b'{"metrics": {"speculative_decoding" 4}}',
        b'{"metrics": {"speculative_decoding": {"a": [[[[[[1]]]]]]}}}',
        b'{"metrics": {"speculative_decoding": {"a": "' + b"x" * (1 << 17) + b'"}}}',
        b'{"metrics": {"speculative_decoding": {"num_spec_steps": 1' + b"0" * 60 + b"}}}",
        b'"speculative_decoding": {\xff\xfe}',
        b'"speculative_decoding"',
    ):
        assert reported_accept_length(None, 9, broken) is None, broken[:60]
