"""One attempt on one backend, up to the point where specroute commits to its answer.

`open_upstream` sends the request and reads what must be seen before anything goes to the
client: a stream's first event (`controller.proxy.sse.first_event` judges it), or a
non-streaming answer whole. It returns an `Upstream` to relay, or raises `UpstreamFailure`
whose `kind` says what the failure means for the rest of the request:

| kind          | what happened                                          | outlier | failover |
|---------------|--------------------------------------------------------|---------|----------|
| `unreachable` | connection refused, or no TCP handshake in time        | counts  | yes      |
| `failed`      | a 5xx (not 503), a redirect or 1xx, a reset            | counts  | yes      |
| `protocol`    | a bad first event, a stream ended before `[DONE]`,     | counts  | yes      |
|               | an answer over `response_limit_bytes`                  |         |          |
| `overload`    | 503 or 429, or SGLang's queue-full first event         | never   | yes      |
| `timeout`     | no first event in `first_byte_timeout_s` (a stream),   | if slow | streams  |
|               | no whole answer in `request_timeout_s` (non-streaming) | for all | only     |
| `budget`      | the answer does not fit in the memory budget           | never   | no       |

Every byte held while reading is charged to the request's `Charge` (`controller.proxy.memory`).
An error answer a backend gives (a 4xx for the client's mistake, or a 5xx with no backend left to
try) reaches the client in OpenAI's shape, the backend's text kept in `message`.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict

from controller.proxy.errors import BackendFailed, BackendTimeout, RetrySoon, SpecrouteError
from controller.proxy.memory import ANSWER_COPIES, Charge
from controller.proxy.sse import (
    BLANK_LINE,
    FIRST_OK,
    FIRST_OVERLOAD,
    ends_with_done,
    first_event,
    last_event_end,
    may_filter,
    parse_json,
)
from controller.proxy.watchdog import ClockTimeout

FailureKind = Literal["unreachable", "failed", "protocol", "overload", "timeout", "budget"]
RESERVE_FROM = 1 << 20
"""Answer bytes up to which the charge follows the bytes read; past it, a first event is charged
for the largest allowed at once, a non-streaming answer doubles ahead."""
COUNTED: frozenset[FailureKind] = frozenset({"unreachable", "failed", "protocol"})
"""Failures the outlier detector counts as they are (a timeout counts only if slow for others)."""


class BackendOverloaded(RetrySoon):
    """Every backend the request could use said its queue is full: retry shortly."""

    code = "backend_overloaded"


class MemoryBudgetExceeded(SpecrouteError):
    """A backend's answer did not fit in the process-wide memory budget."""

    status = 502
    type = "server_error"
    code = "answer_over_memory_budget"


class BackendAnswered(BackendFailed):
    """A backend's own 5xx answer, in OpenAI's shape with the backend's status and text."""

    def __init__(self, message: str, backend_status: int) -> None:
        super().__init__(message)
        self.backend_status = backend_status

    @property
    def http_status(self) -> int:
        return self.backend_status


class UpstreamFailure(Exception):
    """The backend failed before anything was committed to the client."""

    def __init__(self, error: SpecrouteError, kind: FailureKind, *, may_retry: bool = True) -> None:
        super().__init__(error.message)
        self.error = error
        self.kind = kind
        self.may_retry = may_retry


@dataclass(slots=True)
class Upstream:
    resp: aiohttp.ClientResponse
    head: bytes
    """Streams: the bytes up to the end of the first event (and what was buffered). Otherwise
    the body to send: the backend's, or its error translated into OpenAI's shape."""
    streaming: bool
    first_byte_at: float
    opaque: bool = False
    """A compressed stream: relayed byte for byte, its events not looked at."""
    ended: bool = False
    """A stream whose whole answer is in `head` (the backend's end included)."""
    pieces: list[bytes] = field(default_factory=list)
    """A first event larger than `PIECE`: its bytes before `head` as they were read, relayed
    about `PIECE` bytes per turn of the event loop (`FirstEvent.pieces`)."""

    def close(self, read_to_end: bool) -> None:
        """Done with the answer: its connection goes back to the pool when the answer was read
        to its end, else it is closed, so the backend sees the disconnect and aborts the
        generation. The one place a committed answer's response ends (`open_upstream` closes
        those it does not return)."""
        if read_to_end:
            self.resp.release()
        else:
            self.resp.close()


_CODES = {400: "invalid_request", 401: "invalid_api_key", 403: "permission_denied", 404: "not_found"}


def openai_error(status: int, body: bytes, backend: str) -> dict[str, Any]:
    """A backend's error answer as OpenAI's `{"error": {message, type, param, code}}`; the
    backend's own text is kept in `message`."""
    obj = parse_json(body)
    inner = obj.get("error") if isinstance(obj, dict) else None
    source = inner if isinstance(inner, dict) else obj if isinstance(obj, dict) else {}
    message = source.get("message", source.get("detail"))
    if not isinstance(message, str):
        message = body[:2000].decode(errors="replace").strip() or f"HTTP {status}"
    param = source.get("param")
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error" if 400 <= status < 500 else "server_error",
            "param": param if isinstance(param, str) else None,
            "code": _CODES.get(status, "rate_limit_exceeded" if status == 429 else f"backend_http_{status}"),
        }
    }


def _os_reason(e: OSError) -> str:
    return os.strerror(e.errno) if e.errno else type(e).__name__


def _reserve(charge: Charge, size: int, limit: int) -> bool:
    """Charge for a non-streaming answer of `size` bytes so far (no Content-Length): up to
    `ANSWER_COPIES` times a reservation that doubles from `RESERVE_FROM` as the answer grows
    (capped at `limit`). A large answer is refused as soon as the budget cannot hold what it is
    growing towards, after a few MiB read, not after tens of MiB read by many answers that all
    end refused."""
    if size <= RESERVE_FROM:
        return charge.grow_to(ANSWER_COPIES * size)
    target = RESERVE_FROM
    while target < size:
        target *= 2
    return charge.grow_to(ANSWER_COPIES * max(size, min(target, limit)))


async def _read_whole(resp: aiohttp.ClientResponse, limit: int, charge: Charge) -> bytes:
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise _TooLarge(f"answer of {declared} bytes declared, the limit is {limit}")
    if declared is not None and not charge.grow_to(ANSWER_COPIES * declared):
        raise _OverBudget  # before a byte of it is read
    buf = bytearray()
    try:
        while chunk := await resp.content.readany():
            buf += chunk
            if len(buf) > limit:
                raise _TooLarge(f"answer larger than {limit} bytes")
            if not _reserve(charge, len(buf), limit):
                raise _OverBudget
        charge.shrink_to(ANSWER_COPIES * len(buf))  # what was reserved ahead and not needed
        return bytes(buf)
    except BaseException:
        buf.clear()  # the exception's traceback keeps this frame alive until the cyclic GC runs
        raise


def _ends_an_event_within(prev: bytes | bytearray, chunk: bytes) -> bool:
    """Whether an event ends in `chunk` (read right after `prev`): only the new bytes and the
    three before them are searched, and a chunk with no line end at all costs two `memchr`s."""
    if chunk.find(b"\n") < 0 and chunk.find(b"\r") < 0:
        return False
    return last_event_end(prev[-3:] + chunk[:3]) >= 0 or last_event_end(chunk) >= 0


PIECE = 1 << 20
"""A first event larger than this is kept as the reads it came in and relayed `TURN` bytes per
turn of the event loop; a request body larger than this is sent `TURN` bytes per turn."""
TURN = 1 << 20
"""Bytes written per turn of the event loop when a large event or body goes out."""


@dataclass(slots=True)
class FirstEvent:
    """A stream's bytes up to the end of its first event, as `_read_first_event` read them."""

    head: bytes
    """The first event's end (all of it when it is small) and the bytes buffered after it."""
    pieces: list[bytes]
    """A first event larger than `PIECE`: its earlier bytes, as they were read (none else). They
    hold no event end; `marked`: a filter's marker is in them."""
    size: int
    """Bytes of the first event and what was read with it (the pieces and `head`)."""
    marked: bool = False


def _first_event_end(prev: bytes, chunk: bytes) -> int:
    """Offset in `chunk` just past the first event end that ends in it (`prev`: the bytes read
    before, which hold none), or -1."""
    seam = prev[-3:]
    m = BLANK_LINE.search(seam + chunk[:3])
    at = -1 if m is None or m.end() <= len(seam) else m.end() - len(seam)
    m = BLANK_LINE.search(chunk)
    if m is not None and (at < 0 or m.end() < at):
        at = m.end()
    return at


def _marked(before: bytes, chunk: bytes) -> bool:
    """Whether a filter's marker is in `chunk` (read right after `before`), across the seam too."""
    return may_filter(chunk) or may_filter(before[-16:] + chunk[:16])


def _start(pieces: list[bytes], n: int = 4096) -> bytes:
    """The first `n` bytes of `pieces` (all of them when they are fewer)."""
    out: list[bytes] = []
    got = 0
    for piece in pieces:
        out.append(piece[: n - got])
        got += len(out[-1])
        if got >= n:
            break
    return b"".join(out)


async def _room_for_large_event(
    charge: Charge, size: int, attempt: Attempt, clock: Callable[[], float]
) -> None:
    """A first event past `RESERVE_FROM` bytes: charge at once what the largest allowed event
    needs (`ANSWER_COPIES` x `response_limit_bytes`, at most half the budget), waiting for it
    first come first served for up to `budget_wait_s`, without reading more of the stream (the
    backend waits on TCP's flow control). So only as many large first events as the budget
    holds are read at a time, each to its end, and the others wait having read ~1 MiB (charged:
    with half the budget left to the waiters' few MiB each, the head of the queue gets its
    share as soon as a holder is done). Charged as they grew, doubling ahead, they would all be
    read for several MiB and most then refused, their clients coming back at once
    (`benchmarks/hostile_bodies.py`). A first event that half the budget cannot hold is refused."""
    budget = charge.budget
    share = budget.limit // 2
    if ANSWER_COPIES * size > share:
        raise _OverBudget  # can never fit
    await _wait_for(charge, min(share, ANSWER_COPIES * max(size, attempt.limit)), attempt, clock)


async def _wait_for(charge: Charge, n: int, attempt: Attempt, clock: Callable[[], float]) -> None:
    """`charge.grow_to(n)`, waiting in the budget's queue for up to `budget_wait_s` when it does
    not fit now; `_OverBudget` when the wait ends without it."""
    if charge.held >= n:
        return
    try:
        with ClockTimeout(attempt.budget_wait_s, clock):
            await charge.grow_to_waiting(n)
    except TimeoutError:
        charge.budget.refusals += 1
        raise _OverBudget from None


async def _read_first_event(
    resp: aiohttp.ClientResponse, attempt: Attempt, charge: Charge, clock: Callable[[], float]
) -> FirstEvent:
    """The bytes up to the end of the first event, plus what is buffered already; fewer at the
    end of the stream. Only the new bytes of each read are searched (a read without a line end
    costs two `memchr`s), and the charge follows the bytes up to `RESERVE_FROM`, then is taken
    whole for the largest event allowed (`_room_for_large_event`). The reads are kept as they
    came, not joined: a first event over `PIECE` bytes goes to the client as those reads, so no
    step copies or scans more than one read and the event loop keeps serving while a huge first
    event passes (a whole-event join, scan and write would hold the loop for all of it)."""
    limit = attempt.limit
    reads: list[bytes] = []
    size = 0
    prev = b""
    marked = False
    try:
        while True:
            chunk = await resp.content.readany()
            if not chunk:  # the stream ended inside its first event
                if size > PIECE:
                    return FirstEvent(reads.pop(), reads, size, marked)
                return FirstEvent(b"".join(reads), [], size)
            if not size and last_event_end(chunk) >= 0:  # the usual case: one read, no copy
                if not resp.content.at_eof():
                    chunk += resp.content.read_nowait()
                if not charge.grow_to(ANSWER_COPIES * len(chunk)):
                    chunk = b""
                    raise _OverBudget
                return FirstEvent(chunk, reads, len(chunk))
            end = _first_event_end(prev, chunk) if size and _ends_an_event_within(prev, chunk) else -1
            size += len(chunk)
            if end >= 0:
                if not resp.content.at_eof():
                    rest = resp.content.read_nowait()  # what is already buffered: one write, not two
                    size += len(rest)
                    chunk += rest
                if not charge.grow_to(ANSWER_COPIES * size):
                    raise _OverBudget
                charge.shrink_to(ANSWER_COPIES * size)  # what was reserved ahead and not needed
                if size - len(chunk) + end <= PIECE:
                    reads.append(chunk)
                    return FirstEvent(b"".join(reads), [], size)
                marked = marked or _marked(prev, chunk[:end])
                reads.append(chunk[:end])
                return FirstEvent(chunk[end:], reads, size, marked)
            marked = marked or _marked(prev, chunk)
            reads.append(chunk)
            prev = chunk if len(chunk) >= 16 else (prev + chunk)[-16:]
            if size > limit:
                raise _TooLarge(f"first event larger than {limit} bytes")
            if size <= RESERVE_FROM:
                # The first MiB waits too when it does not fit now (the large events before it
                # hold the budget), instead of a 502 and the client's retry at once.
                if not charge.grow_to(ANSWER_COPIES * size, count=False):
                    await _wait_for(charge, ANSWER_COPIES * size, attempt, clock)
            else:
                await _room_for_large_event(charge, size, attempt, clock)
    except BaseException:
        reads.clear()  # the exception's traceback keeps this frame alive until the cyclic GC runs
        chunk = prev = b""
        raise


class _TooLarge(Exception):
    pass


class _OverBudget(Exception):
    pass


class SlicedBody(aiohttp.BytesPayload):
    """A large request body sent `PIECE` bytes per turn of the event loop: the same bytes and
    Content-Length as the plain bytes, but no single write of the whole body holding the loop
    while the kernel copies it to the backend."""

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
        data = memoryview(self._value)
        if content_length is not None:
            data = data[:content_length]
        for at in range(0, len(data), TURN):
            await writer.write(data[at : at + TURN])
            await asyncio.sleep(0)  # a write the socket took whole did not give the loop a turn


@dataclass(frozen=True, slots=True)
class Attempt:
    """What `open_upstream` needs besides the session: where, what, and the bounds."""

    url: str
    name: str
    data: bytes
    headers: CIMultiDict[str]
    stream: bool
    timeout_s: float
    """`first_byte_timeout_s` for a stream, `request_timeout_s` otherwise."""
    limit: int
    """`response_limit_bytes`."""
    budget_wait_s: float = 0.0
    """How long a large first event may wait for room in the memory budget (`admission_wait_s`)."""


async def open_upstream(
    session: aiohttp.ClientSession,
    attempt: Attempt,
    client_timeout: aiohttp.ClientTimeout,
    charge: Charge,
    clock: Callable[[], float],
) -> Upstream:
    resp: aiohttp.ClientResponse | None = None
    try:
        with ClockTimeout(attempt.timeout_s, clock):
            data = attempt.data
            resp = await session.post(
                attempt.url,
                data=data if len(data) <= PIECE else SlicedBody(data),
                headers=attempt.headers,
                timeout=client_timeout,
                allow_redirects=False,
            )
            return await _judge(resp, attempt, charge, clock)
    except BaseException as e:
        if resp is not None:
            resp.close()
        raise _failure(e, attempt) from None


async def _judge(
    resp: aiohttp.ClientResponse, attempt: Attempt, charge: Charge, clock: Callable[[], float]
) -> Upstream:
    name, status = attempt.name, resp.status
    if status < 200 or 300 <= status < 400:
        # A 101 cannot be relayed over this proxy's HTTP/1.1 exchange, and a redirect would send
        # the prompt (or, as a GET, lose it) where the backend says: both are backend errors.
        where = " (a redirect, not followed: check the backend URL)" if "Location" in resp.headers else ""
        raise UpstreamFailure(BackendFailed(f"backend {name} answered HTTP {status}{where}"), "failed")
    encoded = resp.headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
    if attempt.stream and status == 200 and encoded:  # compressed despite identity: relayed as is
        return Upstream(resp, await resp.content.readany(), True, clock(), opaque=True)
    if attempt.stream and status == 200:
        first = await _read_first_event(resp, attempt, charge, clock)
        head, pieces = first.head, first.pieces
        ended = resp.content.at_eof()
        verdict, why = first_event(_start(pieces) if pieces else head, first.size)
        if verdict == FIRST_OVERLOAD:
            raise UpstreamFailure(BackendOverloaded(f"backend {name} is overloaded: {why}"), "overload")
        if verdict != FIRST_OK:
            raise UpstreamFailure(BackendFailed(f"backend {name} sent a bad stream: {why}"), "protocol")
        if ended and not ends_with_done(pieces[-1][-64:] + head if pieces and len(head) < 64 else head):
            empty = not pieces and not head.strip()
            what = "an empty stream" if empty else "a stream that ended before [DONE]"
            raise UpstreamFailure(BackendFailed(f"backend {name} sent {what}"), "protocol")
        if first.marked:  # a filter may have to see the event whole (no SGLang stream does this)
            head, pieces = b"".join([*pieces, head]), []
        return Upstream(resp, head, True, clock(), ended=ended, pieces=pieces)
    body = await _read_whole(resp, attempt.limit, charge)
    if status in (429, 503):
        error = openai_error(status, body, name)["error"]["message"]
        raise UpstreamFailure(BackendOverloaded(f"backend {name} is overloaded: {error}"), "overload")
    if status >= 500:
        error = openai_error(status, body, name)["error"]["message"]
        raise UpstreamFailure(
            BackendAnswered(f"backend {name} answered HTTP {status}: {error}", status), "failed"
        )
    if status >= 400:
        body = json.dumps(openai_error(status, body, name)).encode()
    return Upstream(resp, body, False, clock())


def _failure(e: BaseException, attempt: Attempt) -> BaseException:
    """The failure an exception of an attempt means (a cancellation is passed on as it is)."""
    name = attempt.name
    if isinstance(e, UpstreamFailure | asyncio.CancelledError) or not isinstance(e, Exception):
        return e
    if isinstance(e, aiohttp.ConnectionTimeoutError):  # no TCP handshake: unreachable
        return UpstreamFailure(
            BackendFailed(f"backend {name} did not accept the connection in time"), "unreachable"
        )
    if isinstance(e, TimeoutError):
        if attempt.stream:
            return UpstreamFailure(
                BackendTimeout(f"backend {name} timed out before the first byte"), "timeout"
            )
        return UpstreamFailure(
            BackendTimeout(f"backend {name} did not answer within {attempt.timeout_s:g} s"),
            "timeout",
            may_retry=False,
        )
    if isinstance(e, aiohttp.ClientConnectorError):
        reason = _os_reason(e.os_error)
        return UpstreamFailure(
            BackendFailed(f"backend {name} refused the connection: {reason}"), "unreachable"
        )
    if isinstance(e, _TooLarge):
        return UpstreamFailure(BackendFailed(f"backend {name} sent an {e}"), "protocol")
    if isinstance(e, _OverBudget):
        what = "first event" if attempt.stream else "answer"
        return UpstreamFailure(
            MemoryBudgetExceeded(f"backend {name}'s {what} does not fit in specroute's memory budget now"),
            "budget", may_retry=False,
        )  # fmt: skip
    if isinstance(e, aiohttp.ClientError | OSError):
        return UpstreamFailure(
            BackendFailed(f"backend {name} failed before the first byte: {type(e).__name__}"), "failed"
        )
    return e
