"""Bounded work per request: request bodies read and parsed within limits (bytes, JSON structure,
compression ratio, the memory budget), backend answers of the info routes read within a byte bound.

How it works: what a JSON body costs to parse is set by how many values it holds, not by its
size -- 30 MB of one string parse quickly, 30 MB of `[],[],...` take a long time and many times
the body's size in memory. So
before `json.loads` runs, `JsonBudget` counts the body's structure as it arrives, in slices of
`SLICE` bytes: escaped backslashes and quotes are dropped, string contents cut out (one regex
pass), and the separators (`,` `:`) and brackets left outside strings are counted. Each slice
costs a few C-level passes (linear, no per-character Python) and the reader awaits the network
between slices, so a hostile body never holds the event loop for long; a body over the budget
is refused with 413 as soon as the excess is seen, usually long before its last byte. A body
small enough that it cannot exceed the budget (every value is at least a byte) is not scanned.
Then the body is parsed, its cost bounded by the budget: with `json.loads` on the event loop
when it is under 1 MiB, else in a worker thread in short steps (`load_large_json`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import json.decoder
import json.scanner
import re
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
from aiohttp import web

from controller.proxy.errors import BadRequest, PayloadTooLarge, RequestTimeout, RetrySoon
from controller.proxy.memory import BODY_COPIES, Charge
from controller.proxy.watchdog import Clock, ClockTimeout

SLICE = 128 * 1024
"""Bytes scanned per step (a few ms at worst)."""
_STRING = re.compile(rb'"[^"]*+"')
"""A string once its escapes are gone."""
_BACKSLASH = 0x5C


class JsonBudget:
    """Counts the items (separators and brackets outside strings) of a JSON text fed piecewise,
    and raises `PayloadTooLarge` once it exceeds `max_values` items or `max_containers` objects
    and arrays. It does not validate: `json.loads` does that afterwards."""

    def __init__(self, max_values: int, max_containers: int, *, slice_bytes: int = SLICE) -> None:
        self.max_values = max_values
        self.max_containers = max_containers
        self.slice_bytes = slice_bytes
        self.values = 0
        self.containers = 0
        self.scanned = 0
        """Bytes of the fed text scanned so far."""
        self._inside = False  # the next byte is inside a string
        self._carry = b""  # an escaping backslash that ended the previous slice

    def feed(self, text: bytes | bytearray | memoryview, *, final: bool) -> None:
        """Scan what `text` (the whole text so far) holds beyond `scanned`: whole slices only,
        unless `final`."""
        if final and not self.scanned and len(text) <= min(self.max_values, self.max_containers):
            self.scanned = len(text)  # too short to exceed the budget
            return
        step = self.slice_bytes
        while len(text) - self.scanned >= step or (final and self.scanned < len(text)):
            end = min(len(text), self.scanned + step)
            self._scan(bytes(text[self.scanned : end]), last=final and end == len(text))
            self.scanned = end

    def _scan(self, piece: bytes, *, last: bool) -> None:
        piece = self._carry + piece
        self._carry = b""
        if not last and piece and piece[-1] == _BACKSLASH:
            # A run of backslashes at the end: its pairs are escaped backslashes (dropped below
            # anyway); an odd one escapes the next slice's first byte, so it goes with that slice.
            run = len(piece) - len(piece.rstrip(b"\\"))
            self._carry = b"\\" if run % 2 else b""
            piece = piece[: len(piece) - run]
        # Valid JSON has backslashes only inside strings, each starting a two-byte escape: with
        # escaped backslashes (paired left to right) and escaped quotes gone, the quotes left
        # delimit the strings.
        piece = piece.replace(b"\\\\", b"").replace(b'\\"', b"")
        if self._inside:
            piece = b'"' + piece
        outside = _STRING.sub(b"", piece)
        open_quote = outside.find(b'"')  # a string that goes on in the next slice
        self._inside = open_quote >= 0
        if self._inside:
            outside = outside[:open_quote]
        containers = outside.count(b"[") + outside.count(b"{")
        self.containers += containers
        self.values += containers + outside.count(b",") + outside.count(b":")
        if self.containers > self.max_containers:
            raise PayloadTooLarge(f"request body has more than {self.max_containers} JSON objects and arrays")
        if self.values > self.max_values:
            raise PayloadTooLarge(f"request body has more than {self.max_values} JSON values")


class _Inflater:
    """A request body's Content-Encoding undone in steps of at most `SLICE` decoded bytes, so the
    caller checks its limits between steps and a bomb is never inflated past them. gzip (members
    back to back too) and deflate (zlib-wrapped, or raw as some clients send it); the server
    runs with aiohttp's own decompression off (`app.make_runner`): it inflated as bytes arrived,
    and again for the rest of a refused body while it lingered to read it out, so a refused gzip
    bomb would be inflated whole on the event loop."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._d: Any = None
        self._members = 0

    def _new(self, first: bytes) -> Any:
        if self.encoding == "deflate":
            zlib_wrapped = bool(first[:1]) and first[0] & 0xF == 8
            return zlib.decompressobj(zlib.MAX_WBITS if zlib_wrapped else -zlib.MAX_WBITS)
        return zlib.decompressobj(16 + zlib.MAX_WBITS)

    def steps(self, raw: bytes) -> Iterator[bytes]:
        """The decoded bytes of `raw` (what follows what came before), `SLICE` at most at a time."""
        data = raw
        while True:
            if self._d is None or (self._d.eof and data):
                if self._d is not None and self.encoding == "deflate":  # one stream, nothing after it
                    raise BadRequest("request body could not be read: data after the deflate stream's end")
                self._members += 1
                if self._members > MAX_MEMBERS:
                    raise BadRequest(f"request body could not be read: more than {MAX_MEMBERS} gzip members")
                self._d = self._new(data)
            try:
                out = self._d.decompress(data, SLICE)
            except zlib.error as e:
                raise BadRequest(f"request body could not be read: not valid {self.encoding} ({e})") from None
            full = len(out) == SLICE  # more may be pending inside zlib even with no input left
            data = self._d.unused_data if self._d.eof else self._d.unconsumed_tail
            if out:
                yield out
            if not data and (not full or self._d.eof):
                return

    def finish(self) -> None:
        """BadRequest when the body ended inside a compressed stream."""
        if self._d is not None and not self._d.eof:
            raise BadRequest(f"request body could not be read: truncated {self.encoding} data")


MAX_MEMBERS = 64
"""Most gzip members one body may be made of (each costs a decompressor: a body of many tiny
members would be a loop of them with nothing decoded to yield on)."""
BUDGET_FULL = "specroute is holding as much request data as its memory budget allows"

ENCODINGS = {"gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate"}
"""Request Content-Encodings specroute undoes (`identity` is none)."""


def _inflater(request: web.Request) -> _Inflater | None:
    name = request.headers.get("Content-Encoding", "").strip().lower()
    if name in ("", "identity"):
        return None
    if name not in ENCODINGS:
        raise BadRequest(
            f"unsupported Content-Encoding {name[:40]!r} (gzip and deflate are)", param="Content-Encoding"
        )
    return _Inflater(ENCODINGS[name])


async def read_body(
    request: web.Request,
    *,
    limit: int,
    budget: JsonBudget,
    timeout_s: float,
    charge: Charge | None = None,
    max_ratio: float | None = None,
    wait_s: float = 0.0,
    clock: Clock = time.monotonic,
) -> bytes:
    """The request body, refused with 413 past `limit` bytes (decoded, so a compressed bomb is
    cut early), past `max_ratio` times its compressed length or past `budget`; with 503 when
    `charge` cannot take it from the memory budget (`BODY_COPIES` bytes per byte read; a body
    declared over `GATED_FROM` bytes waits up to `wait_s` for it, `_room_for_body`), with 408
    when not complete within `timeout_s` (on `clock`).

    A compressed body (`_Inflater`) is decoded here, `SLICE` bytes per step with the checks
    between steps and a turn of the event loop every `YIELD_EVERY` bytes. Its ratio is held
    against its declared `Content-Length` when it has one; without one (chunked), against the
    compressed bytes received so far, as it inflates: past the first `SLICE` decoded bytes,
    decoded > `max_ratio` x received is a 413."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"request body too large: {declared} bytes declared, the limit is {limit}")
    inflater = _inflater(request)
    if declared is not None and max_ratio is not None and inflater is not None:
        limit = min(limit, max(SLICE, int(declared * max_ratio)))  # a compressed body's inflation
    if declared is not None and charge is not None and inflater is None:
        await _room_for_body(charge, BODY_COPIES * declared, wait_s if declared > GATED_FROM else 0.0, clock)
    content = request.content
    if inflater is None and declared is not None and content.is_eof():
        # The usual request: a plain body the first read brought whole (its size checked and
        # charged above): taken as it is, without the read loop.
        raw = content.read_nowait()
        if len(raw) > limit:
            raise PayloadTooLarge(f"request body too large: more than {limit} bytes")
        budget.feed(raw, final=True)
        return raw
    ratio = max_ratio if declared is None and inflater is not None else None
    # A BytesIO, not a bytearray: its getvalue() hands over the buffer it grew (no copy while
    # nothing else views it), where bytes(bytearray) copied a 30 MB body once more at its end.
    buf = io.BytesIO()
    size = received = 0
    try:
        with ClockTimeout(None if content.is_eof() else timeout_s, clock):
            while raw := await content.readany():
                received += len(raw)
                for chunk in (raw,) if inflater is None else inflater.steps(raw):
                    buf.write(chunk)
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(f"request body too large: more than {limit} bytes")
                    if ratio is not None and size > SLICE and size > ratio * received:
                        raise PayloadTooLarge(
                            f"compressed request body inflates more than {ratio:g} times "
                            f"({size} bytes from {received})"
                        )
                    if charge is not None and not charge.grow_to(BODY_COPIES * size):
                        raise MemoryBusy(BUDGET_FULL)
                    if size - budget.scanned >= budget.slice_bytes:
                        with buf.getbuffer() as view:  # released before the next write (BytesIO's rule)
                            budget.feed(view, final=False)
                    if inflater is not None and size % YIELD_EVERY < len(chunk):
                        await asyncio.sleep(0)  # a compressed read inflates to many slices
        if inflater is not None:
            inflater.finish()
        with buf.getbuffer() as view:
            budget.feed(view, final=True)
        return buf.getvalue()
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {timeout_s:g} s") from None
    finally:
        buf.close()  # on an error too: the exception's traceback keeps this frame until the cyclic GC


async def _room_for_body(charge: Charge, n: int, wait_s: float, clock: Clock) -> None:
    """Charge `n` bytes for a body before a byte of it is read: at once, or by waiting in the
    budget's queue, first come first served, for up to `wait_s` (reading nothing: TCP's flow
    control holds the sender) when the budget is full now and `n` fits in half of it; else 503.
    Refused at once, each large body would be read out to its end and dropped (aiohttp lingers
    over an unread body) and its client would send it again: most bodies read for nothing, the
    event loop's work that /health waits behind (`benchmarks/hostile_bodies.py` measures it)."""
    budget = charge.budget
    if wait_s <= 0 or n > budget.limit // 2:
        if not charge.grow_to(n):
            raise MemoryBusy(BUDGET_FULL)
        return
    try:
        with ClockTimeout(wait_s, clock):
            await charge.grow_to_waiting(n)
    except TimeoutError:
        budget.refusals += 1
        raise MemoryBusy(BUDGET_FULL) from None


YIELD_EVERY = SLICE
"""Decoded bytes of a compressed body after which its reader gives the event loop a turn."""


LARGE_JSON = 1 << 20
"""Bodies of at least this many bytes are parsed by `load_large_json`."""
WINDOW = 1 << 20
"""Most characters of a JSON string one step of `load_large_json` decodes."""


def _scanstring(s: str, end: int, strict: bool = True) -> tuple[str, int]:
    """`json.decoder.scanstring` (`end`: just past the opening quote) over windows of `WINDOW`
    characters, so no C call holds the GIL for the whole of a huge string. A window is cut
    where the 12 characters before the cut hold no backslash (no escape or surrogate pair is
    split), and decoded on its own with a closing quote added; the string's own closing quote
    inside it ends the scan. A string without escapes (every window decodes to as many
    characters as it has) is returned as one slice of `s`: its windows are checked and let go,
    not kept and joined (a long prose prompt would be held twice more at the join). The result
    is `scanstring`'s (any error: the caller parses again with `json.loads`, for its message)."""
    start = end
    parts: list[str] | None = None
    """The decoded windows, kept from the first one that held an escape (None: none yet)."""
    while end + WINDOW < len(s):
        stop = cut = end + WINDOW
        floor = max(end, stop - 4096)
        while cut > floor and (back := s.rfind("\\", max(floor, cut - 12), cut)) >= 0:
            cut = back
        if cut <= floor or s.rfind("\\", max(end, cut - 12), cut) >= 0:
            break  # escapes all along: the rest in one call
        piece = s[end:cut]
        text, at = _c_scanstring(piece + '"', 0, strict)
        closed = at <= len(piece)  # the string's own closing quote
        if parts is None and len(text) != (at - 1 if closed else len(piece)):
            parts = [s[start:end]]  # an escape: from here on the decoded windows are kept
        if parts is not None:
            parts.append(text)
        if closed:
            return (s[start : end + at - 1] if parts is None else "".join(parts)), end + at
        end = cut
    text, stop = _c_scanstring(s, end, strict)
    if parts is None and end == start:  # a short string: one call decoded it all
        return text, stop
    if parts is None and len(text) == stop - 1 - end:
        return s[start : stop - 1], stop
    if parts is None:
        parts = [s[start:end]]
    parts.append(text)
    return "".join(parts), stop


_c_scanstring: Callable[[str, int, bool], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


class _WindowedDecoder(json.JSONDecoder):
    """The standard decoder with the pure-Python scanner (the one `json` falls back to, same
    results) and `_scanstring` for string values: each step is short, so the event loop's
    thread gets the GIL between them while this runs in a worker thread."""

    def __init__(self) -> None:
        super().__init__()
        self.parse_string = _scanstring
        self.scan_once = json.scanner.py_make_scanner(self)  # type: ignore[attr-defined]


def _load_windowed(raw: bytes) -> Any:
    try:
        return _WindowedDecoder().decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except (ValueError, RecursionError, UnicodeDecodeError):
        return load_json(raw)  # the plain parser's own answer or error, as for any body


async def load_large_json(raw: bytes) -> Any:
    """`load_json` for a body of `LARGE_JSON` bytes or more, in a worker thread and in short
    steps: one `json.loads` of a body this large would hold the event loop for the whole parse
    (`benchmarks/hostile_bodies.py`). Same result, same errors."""
    return await asyncio.to_thread(_load_windowed, raw)


def load_json(raw: bytes) -> Any:
    """`json.loads` with every failure as a 400."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None


class BodiesBusy(RetrySoon):
    """Every turn for a large or compressed request body was taken for `admission_wait_s`."""

    code = "bodies_busy"


GATED_FROM = 1 << 20
"""Request bodies declared larger than this (and every compressed or chunked one) wait for a
turn at the `BodyGate`."""


_NO_TURN: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()


class BodyGate:
    """How many costly request bodies are read at once: those declared over `GATED_FROM` bytes,
    compressed ones (inflating and scanning them is the work, not their bytes on the wire) and
    chunked ones (no declared size). The rest wait, first come first served, reading nothing
    (aiohttp's flow control holds their senders), for up to `wait_s`, then 503 with Retry-After.

    Why: the event loop serves every connection in turn, so /health waits behind one piece of
    work per body being read: with many costly bodies in flight (gzip bombs inflated and scanned
    before their 413, `benchmarks/hostile_bodies.py`) every /health answer would wait behind all
    of them; with a few at once it waits behind a few pieces. Ordinary bodies (under 1 MiB,
    plain, with a Content-Length) never wait here."""

    def __init__(self, slots: int, wait_s: float, clock: Clock = time.monotonic) -> None:
        self.slots = slots
        self.wait_s = wait_s
        self.clock = clock
        self._sem = asyncio.Semaphore(slots)

    @staticmethod
    def gated(request: web.Request) -> bool:
        declared = request.content_length
        return declared is None or declared > GATED_FROM or bool(request.headers.get("Content-Encoding"))

    def turn(self, request: web.Request) -> contextlib.AbstractAsyncContextManager[None]:
        """A turn for `request`'s body if it is a costly one (BodiesBusy after `wait_s`
        without one), held while the body is read; none needed for the others (a shared
        `nullcontext`: an ordinary body costs no generator-based context manager)."""
        return self._turn() if self.gated(request) else _NO_TURN

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        try:
            with ClockTimeout(self.wait_s, self.clock):
                await self._sem.acquire()
        except TimeoutError:
            raise BodiesBusy(
                f"specroute is reading {self.slots} large or compressed request bodies already; retry shortly"
            ) from None
        try:
            yield
        finally:
            self._sem.release()

    @property
    def full(self) -> bool:
        """Whether every turn is taken now."""
        return self._sem.locked()


class MemoryBusy(RetrySoon):
    """The memory budget cannot hold this request now (others hold it): retry shortly."""

    code = "memory_budget_exceeded"


class ResponseTooLarge(aiohttp.ClientPayloadError):
    """A backend's answer exceeded the bound specroute reads into memory."""


async def read_bounded(
    resp: aiohttp.ClientResponse,
    limit: int,
    *,
    charge: Charge | None = None,
    copies: int = 1,
    scan: JsonBudget | None = None,
) -> bytes:
    """A backend's whole body, or `ResponseTooLarge` as soon as it exceeds `limit` bytes. With a
    `charge`, `copies` times the bytes read so far (the declared length, before any is read) are
    taken from the memory budget, else `MemoryBusy`; with a `scan`, the body's JSON structure is
    counted as it arrives (`PayloadTooLarge` past its budget)."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise ResponseTooLarge(f"answer of {declared} bytes declared, the limit is {limit}")
    if charge is not None and declared is not None and not charge.grow_to(copies * declared):
        raise MemoryBusy("specroute's memory budget cannot hold this answer now")
    buf = bytearray()
    try:
        while chunk := await resp.content.readany():
            buf += chunk
            if len(buf) > limit:
                raise ResponseTooLarge(f"answer larger than {limit} bytes")
            if charge is not None and not charge.grow_to(copies * len(buf)):
                raise MemoryBusy("specroute's memory budget cannot hold this answer now")
            if scan is not None:
                scan.feed(buf, final=False)
        if scan is not None:
            scan.feed(buf, final=True)
        return bytes(buf)
    except BaseException:
        buf.clear()  # the exception's traceback keeps this frame alive until the cyclic GC runs
        raise
