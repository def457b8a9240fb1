"""Per-request speculative statistics from SGLang and vLLM, asked for on the client's behalf.

With the setting `spec_details` on, a request sent to an eagle backend carries
`"return_spec_tokens_details": true` (appended to the client's bytes, like the usage option),
and SGLang answers with `sglext.spec_tokens_details` (`spec_verify_ct`,
`spec_accept_length`, ...): per streamed response one extra `choices: []` event before the
usage event, per whole response an `sglext` member. The accept length goes into the request's
`Outcome` (`completion_tokens / spec_verify_ct`, the robust figure across SGLang versions; else
`spec_accept_length`), and what the client did not ask for is removed from the answer, every
other byte unchanged. Off by default: older SGLang versions may reject the field.

vLLM started with `--per-request-spec-decode-metrics summary` (or `detailed`) reports its own:
the `speculative_decoding` member of `metrics` (`num_spec_steps`, `num_accepted_draft_tokens`,
`mean_acceptance_length`, ...) beside the usage of a whole answer, and on a stream's usage event,
which specroute asks for anyway (`lifecycle.ask_for_usage`, dropped again when the client did not
ask for it). vLLM accepts SGLang's field and ignores it (its request models allow extra fields),
so nothing is sent per engine. `reported_accept_length` reads either engine's figure.
"""

from __future__ import annotations

import json
import math
from typing import Any

from controller.proxy.sse import SpecEvents, only_spec_details, parse_json

__all__ = [
    "FIELD",
    "SUFFIX",
    "SpecEvents",
    "accept_length",
    "ask_for_spec_details",
    "drop_sglext_member",
    "reported_accept_length",
    "vllm_accept_length",
]

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


VLLM_MEMBER = b'"speculative_decoding"'
"""The member of vLLM's per-request `metrics` that holds its speculative statistics."""
VLLM_MAX_BYTES = 1 << 16
"""Most bytes of that member's value read (`detailed` adds two arrays of one entry per verify
step: a few kB for a long answer)."""


def vllm_speculation(data: bytes) -> dict[str, Any] | None:
    """The last `"speculative_decoding": {...}` object in `data` (a whole answer, or the tail
    of a stream: whole events), or None. Found by bytes, then only its value parsed (bounded).
    String contents are JSON-escaped (`\\"`), so an answer's text never matches."""
    at = data.rfind(VLLM_MEMBER)
    while at >= 0:
        if at == 0 or data[at - 1] != 0x5C:  # a backslash before it: inside an escaped string
            value = _object_at(data, at + len(VLLM_MEMBER))
            if value is not None:
                return value
        at = data.rfind(VLLM_MEMBER, 0, at)
    return None


def _object_at(data: bytes, at: int) -> dict[str, Any] | None:
    """The JSON object that is the value of the member whose key ends at `at`, or None."""
    head = data[at : at + 64].lstrip()
    if not head.startswith(b":"):
        return None
    start = data.index(b":", at) + 1
    window = data[start : start + VLLM_MAX_BYTES].lstrip()
    if not window.startswith(b"{"):
        return None
    end = _object_end(window)
    if end is None:
        return None
    value = parse_json(window[:end], max_bytes=VLLM_MAX_BYTES, max_depth=4)
    return value if isinstance(value, dict) else None


def _object_end(text: bytes) -> int | None:
    """Offset just past the JSON object `text` starts with (strings skipped), or None."""
    depth, i, n = 0, 0, len(text)
    while i < n:
        ch = text[i]
        if ch == 0x22:  # a string: skip it whole
            i += 1
            while i < n and text[i] != 0x22:
                i += 2 if text[i] == 0x5C else 1
        elif ch in b"{[":
            depth += 1
        elif ch in b"}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def vllm_accept_length(stats: Any) -> float | None:
    """Tokens per verify step of one request from vLLM's `speculative_decoding` statistics: 1 +
    accepted draft tokens / verify steps (the bonus token included, as SGLang's figure and as
    vLLM's `/metrics` counters give it), else its `mean_acceptance_length`; None without a
    verify step (an answer of one token), with a malformed step count, or for a figure no engine
    could report (below 1, above 1 + `num_spec_tokens`)."""
    if not isinstance(stats, dict):
        return None
    value: float | None
    if "num_spec_steps" in stats:
        steps = _count(stats["num_spec_steps"])
        if not steps:
            return None
        accepted = _count(stats.get("num_accepted_draft_tokens"))
        mean = _number(stats.get("mean_acceptance_length"))
        value = 1.0 + accepted / steps if accepted is not None else mean
    else:
        value = _number(stats.get("mean_acceptance_length"))
    drafts = _number(stats.get("num_spec_tokens"))
    if value is None or value < 1.0 or (drafts is not None and drafts > 0 and value > 1.0 + drafts):
        return None
    return value


def reported_accept_length(details: Any, completion_tokens: int | None, data: bytes) -> float | None:
    """A request's accept length as its backend reported it: SGLang's `spec_tokens_details`
    (`details`, found by `SpecEvents` or `drop_sglext_member`), else vLLM's statistics in the
    answer's bytes (`data`: a whole answer, or a stream's tail); None when neither is there."""
    if details is not None:
        return accept_length(details, completion_tokens)
    if data.find(VLLM_MEMBER) < 0:
        return None
    return vllm_accept_length(vllm_speculation(data))


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
