"""Server-sent events as specroute reads a backend's stream: bytes in, events and decisions out.

No I/O here (h11 style): the relay feeds the bytes it read and writes what comes back. What this
module knows of the protocol:

- **Framing** (the SSE spec): a line ends with CRLF, LF or CR, and an event ends with a blank
  line, so `\\n\\n`, `\\r\\n\\r\\n`, `\\r\\r` and their mixtures all end one. `event_ends` finds them;
  a CR at the very end of the bytes counts as a line end (a LF that follows it in the next read
  is the rest of the same CRLF, which a client's parser skips).
- **Hold-back** (`Holdback`): bytes after the last complete event are held until their event is
  whole, so an error event written after a break never lands inside a torn one; bounded by
  `MAX_HELD_BACK` (past it the bytes go out anyway).
- **Filters**: the usage event specroute asked for on the client's behalf (`drop_usage_events`)
  and the `sglext` details event (`SpecEvents`) are removed from whole events, every other byte
  unchanged.
- **The first event** (`first_event`): SGLang's queue-full (HTTP 200, first event
  `{"error": {"code": 503}}`, or on `/generate` an abort output with status 503) is *overload*;
  another error event, or a first event that is not a JSON object, is a *protocol* failure;
  anything else is fine. Only an event that names an error or an abort is parsed (bounded).
- **The end**: every SGLang stream ends with `data: [DONE]` (`ends_with_done`); one that ends
  without it was cut.
- **Bounded JSON** (`parse_json`): size, nesting depth and digits per number are bounded before
  or while `json.loads` runs, and it never raises: a hostile event is None, not a traceback.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

MAX_HELD_BACK = 1 << 16
"""Bytes of an unfinished event held back before they are relayed anyway."""
MAX_JSON_BYTES = 1 << 20
"""Largest event or body `parse_json` parses by default (bigger: None, not parsed)."""
MAX_DEPTH = 64
"""Deepest nesting of objects and arrays `parse_json` accepts."""
MAX_DIGITS = 40
"""Most characters of one JSON number `parse_json` accepts."""
MAX_COUNT = 1 << 40
"""Largest token count believed (a larger one is treated as not reported)."""

_BLANK = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")
"""Two line ends in a row: the end of an event."""
BLANK_LINE = _BLANK
FILTER_MARKERS = (b'"choices":[]', b'"choices": []', b'"sglext"')
"""What `drop_usage_events` and `SpecEvents` look for: bytes without any of them pass unchanged."""
_MARKER = re.compile(b"|".join(re.escape(m) for m in FILTER_MARKERS))
_STRING = re.compile(rb'"[^"]*+"')
_BRACKETS = re.compile(rb"[^\[\]{}]+")


class _TooLong(ValueError):
    pass


def _int(text: str) -> int:
    if len(text) > MAX_DIGITS:
        raise _TooLong(text[:20])
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_DIGITS:
        raise _TooLong(text[:20])
    return float(text)


def _depth(data: bytes) -> int:
    """The deepest nesting of brackets outside JSON strings (any text: a bound, not a check)."""
    outside = _STRING.sub(b"", data.replace(b"\\\\", b"").replace(b'\\"', b""))
    brackets = _BRACKETS.sub(b"", outside)
    steps = (1 if c in b"[{" else -1 for c in brackets)
    return max(accumulate(steps, initial=0))


_DECODER = json.JSONDecoder(parse_int=_int, parse_float=_float)
"""`json.loads(raw, parse_int=_int, parse_float=_float)` built once (with those arguments
`json.loads` builds a decoder and its scanner on every call)."""


def parse_json(data: bytes | str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """`data` parsed as JSON, or None when it is not JSON, is larger than `max_bytes`, nests
    deeper than `max_depth` or holds a number longer than `MAX_DIGITS`. Never raises."""
    if len(data) > max_bytes:
        return None
    raw = data.encode(errors="surrogatepass") if isinstance(data, str) else data
    try:
        if raw.count(b"[") + raw.count(b"{") > max_depth and _depth(raw) > max_depth:
            return None
        return _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except (ValueError, RecursionError, UnicodeDecodeError, TypeError):
        return None


def as_count(value: Any) -> int | None:
    """A token count as reported, or None when it is not a plausible one (a bool, negative, a
    float, larger than `MAX_COUNT`)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    return None


# --- framing ------------------------------------------------------------------------------
# On the per-request path, `data.find(x) < 0` instead of `x not in data`: `in` on bytes first
# tries `x` as an integer (a byte value) and formats and clears a TypeError when it is not.


def last_event_end(data: bytes | bytearray, start: int = 0) -> int:
    """Offset just past the last complete event of `data` (searched from `start`), or -1."""
    if data.find(b"\r", start) < 0:
        at = data.rfind(b"\n\n", start)
        return -1 if at < 0 else at + 2
    end = -1
    for m in _BLANK.finditer(data, start):
        end = m.end()
    return end


def event_span(data: bytes, at: int) -> tuple[int, int]:
    """(start, end) of the event of `data` (whole events) that holds offset `at`."""
    if data.find(b"\r") < 0:
        begin = data.rfind(b"\n\n", 0, at)
        stop = data.find(b"\n\n", at)
        return 0 if begin < 0 else begin + 2, len(data) if stop < 0 else stop + 2
    begin = last_event_end(data[:at])
    m = _BLANK.search(data, at)
    return max(0, begin), len(data) if m is None else m.end()


def ends_an_event(data: bytes) -> bool:
    return last_event_end(data, max(0, len(data) - 4)) == len(data)


def event_data(event: bytes) -> bytes | None:
    """The `data` of one event (its `data:` lines joined with LF), or None when it has none."""
    lines = event.splitlines()
    values = [
        line[6:] if line.startswith(b"data: ") else line[5:] for line in lines if line.startswith(b"data:")
    ]
    if not values:
        return None
    return values[0] if len(values) == 1 else b"\n".join(values)


def first_event_bytes(data: bytes) -> bytes:
    """The bytes of the first complete event of `data` (all of it when none is complete)."""
    m = _BLANK.search(data)
    while m is not None and not data[: m.start()].strip():
        m = _BLANK.search(data, m.end())  # leading blank lines are no event
    return data if m is None else data[: m.end()]


def ends_with_done(data: bytes) -> bool:
    """Whether `data` (the tail of a stream) ends with the `data: [DONE]` event."""
    tail = data[-64:].rstrip(b"\r\n")
    if len(tail) < 16 < len(data):  # line ends past the last 64 bytes: look further back
        tail = data.rstrip(b"\r\n")
    for done in (b"data: [DONE]", b"data:[DONE]"):
        if tail.endswith(done):
            return len(tail) == len(done) or tail[-len(done) - 1] in b"\r\n"
    return False


class Holdback:
    """The bytes after the last complete event, held back until their event is whole."""

    __slots__ = ("limit", "pending")

    def __init__(self, limit: int = MAX_HELD_BACK) -> None:
        self.pending = b""
        """The bytes held back now."""
        self.limit = limit

    def push(self, chunk: bytes) -> bytes:
        """What of the events so far may go out now."""
        if not self.pending and chunk.endswith(b"\n\n") and chunk.find(b"\r", -4) < 0:
            return chunk  # SGLang's usual chunk: whole events
        data = self.pending + chunk if self.pending else chunk
        end = last_event_end(data, max(0, len(self.pending) - 3))
        if end < 0:
            if len(data) >= self.limit:
                self.pending = b""
                return data
            self.pending = data
            return b""
        self.pending = data[end:]
        return data[:end]

    def rest(self) -> bytes:
        out, self.pending = self.pending, b""
        return out


# --- the first event ----------------------------------------------------------------------

FIRST_OK = "ok"
FIRST_OVERLOAD = "overload"
FIRST_PROTOCOL = "protocol"


def _queue_full(error: dict[str, Any]) -> bool:
    code = error.get("code")
    message = error.get("message")
    return code == 503 or code == "503" or (isinstance(message, str) and "queue is full" in message)


def first_event(head: bytes, size: int | None = None) -> tuple[str, str]:
    """(verdict, why) of a stream's first bytes: `FIRST_OK`, `FIRST_OVERLOAD` (queue full) or
    `FIRST_PROTOCOL` (an error event, or not a JSON object within bounds). `size`: how many
    bytes there were when `head` is only their start."""
    if (len(head) if size is None else size) > MAX_JSON_BYTES:  # too large to parse: judged by its start
        start = head[:4096].lstrip()
        if start.startswith((b"data: {", b"data:{")) and start.find(b'"error"') < 0:
            return FIRST_OK, ""
        return FIRST_PROTOCOL, "first event is a large non-object or error"
    if head.startswith(b"data: {"):  # the usual chunk: one data line, LF-framed
        end = head.find(b"\n\n")
        if end > 0 and head.find(b"\n", 0, end + 1) == end and head.find(b"\r", 0, end) < 0:
            line = head[6:end]
            if line.find(b'"error"') < 0 and line.find(b'"abort"') < 0 and line.rstrip().endswith(b"}"):
                return FIRST_OK, ""
    event = first_event_bytes(head)
    data = event_data(event)
    if data is None:
        if event.lstrip().startswith(b":") or not event.strip():
            return FIRST_OK, ""  # a comment or keep-alive first: judged by what follows
        return FIRST_PROTOCOL, "first event has no data"
    if data.strip() == b"[DONE]":
        return FIRST_PROTOCOL, "stream ended before any output"
    if data.find(b'"error"') < 0 and data.find(b'"abort"') < 0:  # the usual chunk: no parse needed
        if data.lstrip().startswith(b"{") and data.rstrip().endswith(b"}"):
            return FIRST_OK, ""
        return FIRST_PROTOCOL, "first event is not a JSON object"
    obj = parse_json(data)
    if not isinstance(obj, dict):
        return FIRST_PROTOCOL, "first event is not a JSON object within bounds"
    error = obj.get("error")
    if isinstance(error, dict):
        if _queue_full(error):
            return FIRST_OVERLOAD, "queue full"
        code = error.get("code")
        if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500:
            return FIRST_OK, ""  # the client's mistake, relayed as the backend said it
        return FIRST_PROTOCOL, "error event: " + str(error.get("message"))[:200]
    if error is not None:
        return FIRST_PROTOCOL, "error event"
    meta = obj.get("meta_info")  # /generate: queue full is an abort output with status 503
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(reason, dict) and reason.get("type") == "abort":
        status = reason.get("status_code")
        if status == 503:
            return FIRST_OVERLOAD, "queue full"
        if isinstance(status, int) and status >= 500:
            return FIRST_PROTOCOL, f"aborted with status {status}"
    return FIRST_OK, ""


# --- filters ------------------------------------------------------------------------------


def may_filter(data: bytes) -> bool:
    """Whether a filter could change `data` (it holds one of `FILTER_MARKERS`)."""
    # every marker starts with a quote: one `memchr` clears most reads of a large event
    return data.find(b'"') >= 0 and _MARKER.search(data) is not None


def drop_usage_events(data: bytes) -> bytes:
    """`data` (whole events) without the usage event (`choices: []` and a usage object) that
    specroute asked for on the client's behalf; every other byte unchanged. Only the events
    around a `"choices":[]` are looked at (one per stream), so the usual chunk costs two scans."""
    for marker in (b'"choices":[]', b'"choices": []'):
        at = data.find(marker)
        while at >= 0:
            begin, stop = event_span(data, at)
            payload = event_data(data[begin:stop])
            obj = parse_json(payload) if payload is not None and payload.find(b'"usage"') >= 0 else None
            if isinstance(obj, dict) and obj.get("choices") == [] and isinstance(obj.get("usage"), dict):
                data = data[:begin] + data[stop:]
                at = data.find(marker, begin)
            else:
                at = data.find(marker, stop)
    return data


def only_spec_details(obj: Any) -> dict[str, Any] | None:
    """The details of an object whose `sglext` holds nothing but them, else None."""
    if not isinstance(obj, dict):
        return None
    ext = obj.get("sglext")
    if isinstance(ext, dict) and set(ext) == {"spec_tokens_details"}:
        details = ext["spec_tokens_details"]
        return details if isinstance(details, dict) else None
    return None


class SpecEvents:
    """Finds the details event of a streamed answer (whole events in) and keeps the details it
    carried; with `strip` (specroute asked for them, not the client) removes the event, every
    other byte unchanged."""

    __slots__ = ("details", "strip_event")

    def __init__(self, strip: bool) -> None:
        self.strip_event = strip
        self.details: dict[str, Any] | None = None

    def strip(self, data: bytes) -> bytes:
        at = data.find(b'"sglext"')
        while at >= 0:
            begin, stop = event_span(data, at)
            payload = event_data(data[begin:stop])
            obj = parse_json(payload) if payload is not None else None
            details = None
            if isinstance(obj, dict) and obj.get("choices") == [] and obj.get("usage") is None:
                details = only_spec_details(obj)
            if details is not None:
                self.details = details
                if self.strip_event:
                    data = data[:begin] + data[stop:]
                    at = data.find(b'"sglext"', begin)
                    continue
            at = data.find(b'"sglext"', stop)
        return data


def error_event(body: dict[str, Any]) -> bytes:
    """An error body as the SSE event that ends a stream, followed by `[DONE]`."""
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"
