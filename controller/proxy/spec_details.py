"""Per-request speculative statistics from SGLang, asked for on the client's behalf.

With the setting `spec_details` on, a request sent to an eagle backend carries
`"return_spec_tokens_details": true` (appended to the client's bytes, like the usage option),
and SGLang answers with `sglext.spec_tokens_details` (`spec_verify_ct`,
`spec_accept_length`, ...): per streamed response one extra `choices: []` event before the
usage event, per whole response an `sglext` member. The accept length goes into the request's
`Outcome` (`completion_tokens / spec_verify_ct`, the robust figure across SGLang versions; else
`spec_accept_length`), and what the client did not ask for is removed from the answer, every
other byte unchanged. Off by default: older SGLang versions may reject the field.
"""

from __future__ import annotations

import json
from typing import Any

from controller.proxy.sse import SpecEvents, only_spec_details, parse_json

__all__ = ["FIELD", "SUFFIX", "SpecEvents", "accept_length", "ask_for_spec_details", "drop_sglext_member"]

FIELD = "return_spec_tokens_details"
SUFFIX = b', "return_spec_tokens_details": true}'
"""What specroute appends to a request body that does not ask for the details itself."""


def ask_for_spec_details(raw: bytes, body: dict[str, Any]) -> bytes | None:
    """`raw` (the body about to be sent; `body`: the client's, parsed) asking for the details,
    or None when the client asked for them (or said no) itself. The bytes are kept: the field is
    appended."""
    if FIELD in body:
        return None
    head = raw.strip()
    if head.startswith(b"{") and head.endswith(b"}"):
        return head[:-1] + SUFFIX
    parsed = parse_json(raw, max_bytes=len(raw))
    return json.dumps({**(parsed if isinstance(parsed, dict) else body), FIELD: True}).encode()


def accept_length(details: Any, completion_tokens: int | None) -> float | None:
    """Tokens per verify step of one request from its `spec_tokens_details`, or None."""
    if not isinstance(details, dict):
        return None
    verify = details.get("spec_verify_ct")
    if isinstance(verify, int) and not isinstance(verify, bool) and verify > 0 and completion_tokens:
        return completion_tokens / verify
    value = details.get("spec_accept_length")
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def drop_sglext_member(body: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """A whole JSON answer without its top-level `"sglext"` member when that member holds only
    the details (every other byte unchanged), and the details; the answer as is otherwise."""
    if body.find(b'"sglext"') < 0:
        return body, None
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return body, None
    span = _member_span(text, "sglext")
    if span is None:
        return body, None
    start, _, end, parsed = span
    details = only_spec_details({"sglext": parsed})
    if details is None:
        return body, None
    # remove the member together with one of the commas around it
    before = text.rfind(",", 0, start)
    if before >= 0 and not text[before + 1 : start].strip():
        return (text[:before] + text[end:]).encode(), details
    rest = text[end:].lstrip()
    if rest.startswith(","):
        return (text[:start] + rest[1:].lstrip()).encode(), details
    return (text[:start] + text[end:]).encode(), details


def _member_span(text: str, key: str) -> tuple[int, int, int, Any] | None:
    """(start of the key, start of the value, end of the value, the value) of a top-level member
    of the JSON object `text`, or None."""
    decoder = json.JSONDecoder()
    depth = 0
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':  # a string: skip it whole
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if depth == 1 and text[i + 1 : j] == key:
                k = j + 1
                while k < n and text[k].isspace():
                    k += 1
                if k < n and text[k] == ":":
                    k += 1
                    while k < n and text[k].isspace():
                        k += 1
                    try:
                        value, end = decoder.raw_decode(text, k)
                    except (ValueError, RecursionError):
                        return None
                    return i, k, end, value
            i = j + 1
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        i += 1
    return None
