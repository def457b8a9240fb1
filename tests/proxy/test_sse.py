"""Properties of the pure SSE module (`controller.proxy.sse`), with hypothesis: any framing the
SSE spec allows (LF, CRLF, CR), any split of the bytes into reads, any hostile JSON -- the relay's
output is the input byte for byte, events go out whole, filters remove exactly the events they
name, and nothing raises."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from typing import Any, Literal

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.proxy.sse import (
    FIRST_OK,
    FIRST_OVERLOAD,
    FIRST_PROTOCOL,
    Holdback,
    SpecEvents,
    drop_usage_events,
    ends_an_event,
    ends_with_done,
    event_data,
    first_event,
    last_event_end,
    parse_json,
)

ENDS = [b"\n", b"\r\n", b"\r"]
SURROGATES: tuple[Literal["Cs"]] = ("Cs",)
texts = st.text(
    alphabet=st.characters(blacklist_categories=SURROGATES, blacklist_characters="\r\n"), max_size=30
)


def frame(payloads: list[bytes], end: bytes) -> bytes:
    return b"".join(b"data: " + p + end + end for p in payloads)


def payload(text: str) -> bytes:
    return json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode()


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def relay(pieces: list[bytes]) -> tuple[list[bytes], bytes]:
    held = Holdback()
    out = [held.push(p) for p in pieces]
    return [o for o in out if o], held.rest()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(texts, min_size=1, max_size=8),
    st.sampled_from(ENDS),
    st.lists(st.integers(0, 10_000), max_size=12),
)
def test_holdback_relays_every_byte_and_only_whole_events(
    texts_: list[str], end: bytes, cuts: list[int]
) -> None:
    data = frame([payload(t) for t in texts_], end)
    out, rest = relay(splits(data, cuts))
    assert b"".join(out) + rest == data  # byte for byte, in order
    assert rest == b"" or (end == b"\r\n" and rest == b"\n")  # a CR just before a cut may end an event
    for piece in out:  # each piece ends where an event ends
        assert ends_an_event(piece) or piece.endswith(b"\r")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.lists(st.integers(0, 1000), max_size=10))
def test_holdback_never_loses_or_reorders_arbitrary_bytes(data: bytes, cuts: list[int]) -> None:
    out, rest = relay(splits(data, cuts))
    assert b"".join(out) + rest == data


def test_holdback_is_bounded_without_an_event_end() -> None:
    held = Holdback(limit=1000)
    assert held.push(b"data: " + b"x" * 600) == b""
    assert len(held.push(b"y" * 600)) == 1206  # past the bound it goes out anyway
    assert held.pending == b""


@given(st.lists(texts, min_size=1, max_size=5), st.sampled_from(ENDS))
def test_the_end_is_found_in_every_framing(texts_: list[str], end: bytes) -> None:
    data = frame([payload(t) for t in texts_], end)
    assert last_event_end(data) == len(data)
    assert ends_with_done(data + b"data: [DONE]" + end + end)
    assert not ends_with_done(data)
    assert event_data(b"data: " + payload(texts_[0]) + end + end) == payload(texts_[0])


@settings(max_examples=200, deadline=None)
@given(st.lists(texts, min_size=1, max_size=5), st.sampled_from(ENDS), st.booleans())
def test_the_usage_filter_removes_exactly_the_usage_event(
    texts_: list[str], end: bytes, spaced: bool
) -> None:
    usage: dict[str, Any] = {"id": "x", "choices": [], "usage": {"completion_tokens": 3}}
    raw = json.dumps(usage) if spaced else json.dumps(usage, separators=(",", ":"))
    kept = [payload(t) for t in texts_]
    data = frame(kept, end) + frame([raw.encode()], end) + frame([b"[DONE]"], end)
    assert drop_usage_events(data) == frame(kept, end) + frame([b"[DONE]"], end)


def test_the_spec_filter_keeps_the_details_and_removes_the_event_in_any_framing() -> None:
    details = {"spec_verify_ct": 4, "spec_accept_length": 2.5}
    event: dict[str, Any] = {"choices": [], "usage": None, "sglext": {"spec_tokens_details": details}}
    for end in ENDS:
        data = frame([payload("a"), json.dumps(event).encode(), b"[DONE]"], end)
        spec = SpecEvents(strip=True)
        assert spec.strip(data) == frame([payload("a"), b"[DONE]"], end)
        assert spec.details == details


HOSTILE = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"a": ' + b"9" * 5000 + b"}",
    b'{"a": 1' + b"0" * 400 + b".5}",
    b'{"a": "' + b"\\" * 3 + b'"}',
    b"\xff\xfe{",
]


def test_parse_json_is_bounded_and_never_raises() -> None:
    for data in HOSTILE:
        assert parse_json(data) is None
    assert parse_json(b'{"a": [1, {"b": "]]]]]]"}]}') == {"a": [1, {"b": "]]]]]]"}]}
    assert parse_json(b"[" * 64 + b"]" * 64) is not None  # the bound itself is allowed
    assert parse_json(b"x" * 10, max_bytes=5) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_first_event_judges_any_bytes_without_raising(data: bytes) -> None:
    verdict, why = first_event(b"data: " + data + b"\n\n")
    assert verdict in (FIRST_OK, FIRST_OVERLOAD, FIRST_PROTOCOL) and isinstance(why, str)


def test_first_event_verdicts() -> None:
    queue_full = {"error": {"object": "error", "message": "The request queue is full.", "code": 503}}
    abort = {"text": "", "meta_info": {"finish_reason": {"type": "abort", "status_code": 503}}}
    cases = [
        (frame([payload("a")], b"\r\n"), FIRST_OK),
        (frame([json.dumps(queue_full).encode(), b"[DONE]"], b"\n"), FIRST_OVERLOAD),
        (frame([json.dumps(abort).encode()], b"\n"), FIRST_OVERLOAD),
        (frame([json.dumps({"error": {"message": "boom", "code": 500}}).encode()], b"\n"), FIRST_PROTOCOL),
        (frame([b'{"error": ' + b"[" * 5000 + b"]" * 5000 + b"}"], b"\n"), FIRST_PROTOCOL),
        (frame([b'{"error": {"code": ' + b"5" * 400 + b"}}"], b"\n"), FIRST_PROTOCOL),
        (frame([b"[DONE]"], b"\n"), FIRST_PROTOCOL),
        (b": keep-alive\n\n", FIRST_OK),
    ]
    for head, verdict in cases:
        assert first_event(head)[0] == verdict, head[:80]


def test_the_sse_module_imports_no_aiohttp() -> None:
    code = "import sys, controller.proxy.sse; print('aiohttp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
