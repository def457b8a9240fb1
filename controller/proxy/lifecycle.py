"""The HTTP life of one routed request, from its `Ticket` to its `Outcome`.

How it works: `RequestLifecycle.run` owns the request once its ticket is issued: it sends it
(`upstream.py`), fails over once where that is safe (`Ticket.move`), relays the answer (`sse.py`
reads the stream) and, in its `finally` on every path including cancellation, ends it. Its
`RequestState` (`controller.proxy.phases`) is the one writer of the request's status: each
event below is a transition there, and the ending transition finishes the ticket (release, the
`Outcome`, the policy, the metrics, the observers). The forwarder that started it reads nothing
back. What every lifecycle shares (bounds, clock, session, memory budget, where attempts are
reported) is the app's `Relay`.

The rules it keeps:
- Before any byte reached the client a failure may fail over (once; see `upstream.py` for which
  failures may, and which count for the outlier detector). After it, nothing is sent again: a
  stream ends with an OpenAI-shaped error event and `[DONE]` (`terminal_bytes`), a
  non-streaming answer's connection is closed -- never a second response inside the first.
- A stream that ends without the backend's `[DONE]`, inside an event, or with a broken or silent
  connection is an error, for the metrics and for the outlier detector.
- Any unexpected exception after the response started is logged and ends the stream the same
  way, so the client always gets well-formed bytes.
- A cancellation while streaming (a shutdown's drain timeout; a client that left cannot read
  it) first tries, briefly, to end the stream with that same error event and `[DONE]`.
- The backend's response is closed in one place (`Upstream.close`, in `run`), before the slot is
  released: given back to the pool when it was read to its end, else closed so the backend
  aborts the generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from controller.proxy.errors import NoBackendAvailable, SpecrouteError, StreamBroken
from controller.proxy.generate import generate_completion_tokens
from controller.proxy.headers import PoolRewrite, client_headers
from controller.proxy.identity import BackendIdentity
from controller.proxy.memory import ANSWER_COPIES, Charge, MemoryBudget
from controller.proxy.phases import STREAMING, RequestState
from controller.proxy.prefixes import last_count, reported_cached_tokens, reported_prompt_tokens
from controller.proxy.spec_details import ask_for_spec_details, drop_sglext_member, reported_accept_length
from controller.proxy.sse import (
    Holdback,
    SpecEvents,
    as_count,
    drop_usage_events,
    ends_an_event,
    ends_with_done,
    last_event_end,
)
from controller.proxy.ticket import AttemptReports, Ticket
from controller.proxy.upstream import (
    COUNTED,
    TURN,
    Attempt,
    BackendAnswered,
    BackendOverloaded,
    Upstream,
    UpstreamFailure,
    open_upstream,
)
from controller.proxy.watchdog import ClockTimeout, RelayWatchdog, Stalled

if TYPE_CHECKING:
    from prometheus_client import Counter

    from controller.proxy.config import Settings
    from controller.proxy.load import BackendState


log = logging.getLogger("specroute.forward")

TAIL_BYTES = 1 << 20
"""Most bytes of one chunk kept for the stream's end (`[DONE]`, the usage counts)."""
CUT_WRITE_S = 0.25
"""How long a cancelled stream may take to write its closing error event."""


def abort(request: web.Request) -> None:
    """Drop the client's connection now: `close()` would wait to flush what it does not read."""
    transport = request.transport
    if transport is not None:
        transport.abort()


def _keep_tail(tail: list[bytes], chunk: bytes) -> None:
    """Keep the stream's last chunks (`[DONE]` and the usage counts are near its end)."""
    if len(chunk) <= TAIL_BYTES:
        tail[0], tail[1], tail[2] = tail[1], tail[2], chunk
    else:  # a huge chunk: its end is all the tail needs (no copy of the rest)
        tail[0], tail[1], tail[2] = b"", b"", chunk[-TAIL_BYTES:]


def terminal_bytes(message: str) -> bytes:
    """What ends a stream that cannot end as the backend meant: an error event and `[DONE]`."""
    return StreamBroken(message).sse_event()


USAGE_SUFFIX = b', "stream_options": {"include_usage": true}}'
"""What specroute appends to a streaming request body that has no `stream_options`."""


def ask_for_usage(raw: bytes, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]] | None:
    """(raw, body) of a stream whose client did not ask for the usage chunk, with
    `stream_options.include_usage` switched on; None when there is nothing to change. Without it
    SGLang reports no token count, so the outcome (decode rate, `online`'s learning, metrics, the
    decision log) would lack it. The client's bytes are kept: the option is appended."""
    if body.get("stream") is not True:
        return None
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or options.get("include_usage") is True):
        return None  # asked for already, or malformed (the backend answers that)
    asked = {**body, "stream_options": {**(options or {}), "include_usage": True}}
    head = raw.rstrip()
    if "stream_options" not in body and head.startswith(b"{") and head.endswith(b"}"):
        return head[:-1] + USAGE_SUFFIX, asked  # UTF-8 (or ASCII) JSON: append, keep every byte
    return json.dumps(asked).encode(), asked


@dataclass(frozen=True, slots=True)
class RelayLimits:
    """The settings a lifecycle reads."""

    first_byte_timeout_s: float
    request_timeout_s: float
    idle_timeout_s: float
    client_write_timeout_s: float
    connect_timeout_s: float
    response_limit_bytes: int
    budget_wait_s: float
    """How long a large first event may wait for room in the memory budget (`admission_wait_s`)."""
    spec_details: bool
    backend_header: bool

    @classmethod
    def from_settings(cls, s: Settings) -> RelayLimits:
        return cls(
            s.first_byte_timeout_s, s.request_timeout_s, s.idle_timeout_s, s.client_write_timeout_s,
            s.connect_timeout_s, s.response_limit_bytes, s.admission_wait_s, s.spec_details, s.backend_header,
        )  # fmt: skip


class Relay:
    """What every request's lifecycle in one app shares: its bounds, the clock, the upstream
    session (set when the app starts), the memory budget, what clients may learn of the
    backends, where attempts are reported, the per-pool rewrite, and the live relays."""

    def __init__(
        self,
        limits: RelayLimits,
        *,
        clock: Callable[[], float],
        budget: MemoryBudget,
        identity: BackendIdentity,
        reports: AttemptReports,
        rewrite: PoolRewrite,
        client_stalls: Counter,
    ) -> None:
        self.limits = limits
        self.clock = clock
        self.budget = budget
        self.identity = identity
        """What clients may learn of the backends: every client-bound message passes it."""
        self.reports = reports
        self.rewrite = rewrite
        self.client_stalls = client_stalls
        self.session: aiohttp.ClientSession | None = None
        self.client_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=limits.connect_timeout_s, connect=None, sock_read=None
        )
        self.relays: set[RelayWatchdog] = set()
        """The watchdogs of the streams being relayed (`specroute_client_writes_blocked` reads them)."""


class RequestLifecycle:
    """One forwarded request (see the module's note)."""

    def __init__(
        self,
        relay: Relay,
        ticket: Ticket,
        request: web.Request,
        body: dict[str, Any],
        raw: bytes,
        path: str,
        headers: CIMultiDict[str],
        body_charge: Charge | None = None,
    ) -> None:
        self.relay = relay
        self.ticket = ticket
        self.state = RequestState(ticket)
        self.request = request
        self.headers = headers
        self.body, self.raw = body, raw
        self.path = path
        self.body_charge = body_charge
        self.charge = Charge(relay.budget)
        """The answer's bytes held (first event, whole answer, held-back bytes)."""
        ticket.hold(self.charge)
        self.strip_usage = False
        """specroute asked for the usage chunk on the client's behalf: it is not relayed."""
        self.spec: SpecEvents | None = None
        self.stream_response: web.StreamResponse | None = None
        """The client's streamed answer, once one is under way."""
        # What the answer reported, for the request's end.
        self.tokens: int | None = None
        self.accept_length: float | None = None
        self.cached_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.blocked_s = 0.0

    # -- running --

    async def run(self) -> web.StreamResponse:
        try:
            if self.ticket.info.endpoint != "generate":  # /generate: meta_info has the counts
                asked = ask_for_usage(self.raw, self.body)
                if asked is not None:
                    self.raw, self.body = asked
                    self.strip_usage = True
            up = await self._connect()
            try:
                return await self._answer(up)
            finally:
                # The one place a backend's answer ends, before the slot is released below (so
                # the backend has seen a cut answer's disconnect by then).
                up.close(read_to_end=not up.streaming or self.state.status == "ok")
        except asyncio.CancelledError:
            # The client went away, or a shutdown cut the request: whatever it did not read
            # must not keep its connection (and buffer) alive.
            streaming = self.state.phase == STREAMING
            self.state.client_gone()
            if streaming:
                await self._cut(self.stream_response)
            abort(self.request)
            raise
        finally:
            self.state.end(
                self.relay.clock(), completion_tokens=self.tokens, accept_length=self.accept_length,
                cached_tokens=self.cached_tokens, prompt_tokens=self.prompt_tokens,
                client_blocked_s=self.blocked_s,
            )  # fmt: skip

    async def _answer(self, up: Upstream) -> web.StreamResponse:
        """The committed answer to the client: a whole one, or the stream relayed."""
        # Committed: nothing is sent upstream again, so the body need not live on.
        self.raw, self.body = b"", {}
        if self.body_charge is not None:
            self.body_charge.release()
        self.relay.reports.progressed(self.ticket.backend)
        if not up.streaming:
            return await self._whole(up)
        self.state.stream(up.resp.status, up.first_byte_at)
        sr = self.stream_response = web.StreamResponse(
            status=up.resp.status, headers=self._client_headers(up.resp)
        )
        return await self._relay(up, sr)

    def _client_headers(self, resp: aiohttp.ClientResponse) -> CIMultiDict[str]:
        return client_headers(
            resp.headers, self.ticket.decision, show_backend=self.relay.limits.backend_header
        )

    async def _cut(self, sr: web.StreamResponse | None) -> None:
        """A cancelled stream that reached the client: end it with the error event if it can
        be written at once (a shutdown's drain timeout cut it; a gone client cannot read it)."""
        transport = self.request.transport
        if sr is None or not sr.prepared or transport is None or transport.is_closing():
            return
        try:
            with ClockTimeout(CUT_WRITE_S, self.relay.clock):
                await sr.write(terminal_bytes("stream cut: specroute is shutting down"))  # names no backend
                await sr.write_eof()
        except BaseException:
            pass

    # -- connecting --

    def _attempt(self, backend: BackendState, data: bytes, hdrs: CIMultiDict[str]) -> Attempt:
        limits = self.relay.limits
        stream = self.ticket.info.stream
        return Attempt(
            url=backend.url + self.path,
            name=backend.name,
            data=data,
            headers=hdrs,
            stream=stream,
            timeout_s=limits.first_byte_timeout_s if stream else limits.request_timeout_s,
            limit=limits.response_limit_bytes,
            budget_wait_s=limits.budget_wait_s,
        )

    async def _try(self, backend: BackendState) -> Upstream:
        relay = self.relay
        data, hdrs = relay.rewrite.apply(backend.pool, self.raw, self.body, self.headers)
        self.spec = None
        # /generate is left alone: its meta_info has no sglext member to ask for and strip.
        if relay.limits.spec_details and backend.pool == "eagle" and self.ticket.info.endpoint != "generate":
            asked = ask_for_spec_details(data, self.body)
            self.spec = SpecEvents(strip=asked is not None)
            data = asked or data
        self.state.send(relay.clock())
        assert relay.session is not None, "the app's cleanup_ctx has not started"
        return await open_upstream(
            relay.session, self._attempt(backend, data, hdrs), relay.client_timeout, self.charge, relay.clock
        )

    async def _connect(self) -> Upstream:
        ticket = self.ticket
        clock = self.relay.clock
        tried: set[str] = set()
        error: SpecrouteError | None = None
        while True:
            backend = ticket.backend
            tried.add(backend.name)
            attempt_sent = clock()
            try:
                return await self._try(backend)
            except UpstreamFailure as f:
                self.charge.release()
                self._report(backend, f, attempt_sent)
                alt = None
                if f.may_retry and len(tried) < 2:
                    alt = ticket.failover_target(tried)
                if alt is None:
                    error = self._give_up(f, tried)
            if alt is None:
                # Raised here, not in the `except`: there the failure would become the error's
                # context while it holds the error (`failure.error`), a cycle keeping every frame
                # of the attempt, the backend's buffered bytes with them, until the cyclic GC ran.
                assert error is not None
                try:
                    raise error
                finally:
                    error = None
            ticket.move(alt)

    def _report(self, backend: BackendState, failure: UpstreamFailure, sent_at: float) -> None:
        """An attempt failed before the commit (`upstream.py`'s table says what counts)."""
        reports = self.relay.reports
        if failure.kind == "overload":
            reports.overloaded(backend)
        elif failure.kind == "timeout":
            reports.timed_out(backend, sent_at, failure.error.message)
        elif failure.kind in COUNTED:
            reports.failed(backend, failure.error.message)

    def _give_up(self, failure: UpstreamFailure, tried: set[str]) -> SpecrouteError:
        error = failure.error
        if failure.kind == "unreachable" and self.ticket.tried_every_usable(tried):
            # Every backend is down (this request just found the last one refusing): that is
            # "no healthy backend", the same answer later requests get at once.
            error = NoBackendAvailable(f"no healthy backend ({failure.error.message})")
        if isinstance(error, BackendAnswered | BackendOverloaded):  # the backend's answer: say whose
            shown = client_headers({}, self.ticket.decision, show_backend=self.relay.limits.backend_header)
            error.headers.update(shown)
        self.state.give_up("timeout" if failure.kind == "timeout" else "error", error.http_status)
        return error

    # -- a whole answer --

    async def _whole(self, up: Upstream) -> web.StreamResponse:
        resp = up.resp
        self.state.answer(resp.status)
        self.relay.reports.succeeded(self.ticket.backend)
        body = up.head
        if resp.status == 200:
            self._read_usage(body)
            if self.spec is not None:
                stripped, details = drop_sglext_member(body)
                self.accept_length = reported_accept_length(details, as_count(self.tokens), body)
                if self.spec.strip_event:
                    body = stripped
        headers = self._client_headers(resp)
        if resp.status >= 400:
            headers["Content-Type"] = "application/json"
        out = web.Response(status=resp.status, body=body, headers=headers)
        # Written here, not by aiohttp after the handler returns, so a client that does not read
        # is given up after client_write_timeout_s instead of holding its connection forever.
        clock = self.relay.clock
        limit = self.relay.limits.client_write_timeout_s
        began = clock()
        try:
            with ClockTimeout(limit, clock):
                await out.prepare(self.request)
                await out.write_eof()
        except TimeoutError:
            self._client_stalled(limit)
        except ConnectionResetError:
            self.state.client_gone()
        self.blocked_s = clock() - began
        return out

    def _read_usage(self, data: bytes) -> None:
        """The counts the answer's usage (or `meta_info`) reports."""
        if self.ticket.info.endpoint == "generate":
            self.tokens = generate_completion_tokens(data)
        else:
            self.tokens = last_count(data, b"completion_tokens")
        self.prompt_tokens = reported_prompt_tokens(data)
        self.cached_tokens = reported_cached_tokens(data)

    def _client_stalled(self, seconds: float) -> None:
        log.info(
            "client of a request to %s took nothing for %g s: answer given up",
            self.ticket.backend.name,
            seconds,
        )
        self.state.client_gone()
        self.relay.client_stalls.inc()
        abort(self.request)

    # -- a stream --

    def _filter(self, chunk: bytes, strip_usage: bool) -> bytes:
        if strip_usage:
            chunk = drop_usage_events(chunk)
        if self.spec is not None:
            chunk = self.spec.strip(chunk)
        return chunk

    async def _relay(self, up: Upstream, sr: web.StreamResponse) -> web.StreamResponse:
        try:
            await sr.prepare(self.request)
            await self._pump(up, sr)
        except ConnectionResetError:
            self.state.client_gone()
        except Exception as e:  # a bug must not put a second response inside this one
            log.exception("relaying a stream from %s failed", self.ticket.backend.name)
            self.state.crash()
            await self._break(sr, f"specroute failed relaying the stream: {type(e).__name__}")
        return sr

    async def _pump(self, up: Upstream, sr: web.StreamResponse) -> None:
        """Relay the stream to its end; the state judges how it ended."""
        strip_usage = self.strip_usage and not up.opaque
        limits = self.relay.limits
        content = up.resp.content
        clock = self.relay.clock
        tail = [b"", b"", b""]
        held = Holdback()
        charge, spec = self.charge, self.spec
        chunk = up.head
        dog = RelayWatchdog(limits.idle_timeout_s, limits.client_write_timeout_s, clock, self.relay.relays)
        try:
            with dog:
                if up.pieces:
                    await self._relay_pieces(up.pieces, sr, dog, tail, len(chunk))
                    if not chunk and not (up.ended or content.at_eof()):
                        chunk = await content.readany()
                while chunk:
                    _keep_tail(tail, chunk)
                    if up.ended or content.at_eof():
                        break  # the last piece goes out with the terminating chunk, in one write
                    if not up.opaque:
                        chunk = held.push(chunk)
                        if held.pending and not charge.grow_to(len(held.pending)):
                            await self._broken(sr, "an unfinished event does not fit in the memory budget")
                            return
                    if strip_usage:
                        chunk = drop_usage_events(chunk)
                    if spec is not None:
                        chunk = spec.strip(chunk)
                    if chunk:
                        began = clock()
                        dog.writing(began)
                        await sr.write(chunk)
                        now = clock()
                        dog.reading(now, now - began)
                        if charge.held:  # the first event is out: only what is held back stays charged
                            charge.shrink_to(len(held.pending))
                    chunk = await content.readany()
                # The end, inside the watchdog: its last write is timed by the stream's timer
                # (`writing`), not by a timer of its own.
                await self._end(up, sr, held.rest() + chunk, b"".join(tail), strip_usage, dog)
        except Stalled as e:
            if e.side == "client":
                self._client_stalled(e.seconds)
                return
            if self.state.phase == STREAMING:  # (a silence while an error event is written: judged)
                self.state.judge("timeout")
                backend = self.ticket.backend
                self.relay.reports.timed_out(backend, self.state.sent_at, f"silent for {e.seconds:g} s")
                await self._break(sr, f"backend {backend.name} sent nothing for {e.seconds:g} s")
        except (aiohttp.ClientError, OSError) as e:
            transport = self.request.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError from None  # our own client went away (write failed)
            await self._broken(sr, f"stream broke: {type(e).__name__}")
        finally:
            self.blocked_s = dog.blocked_s

    async def _relay_pieces(
        self, pieces: list[bytes], sr: web.StreamResponse, dog: RelayWatchdog, tail: list[bytes], after: int
    ) -> None:
        """A first event larger than `PIECE` (`upstream.FirstEvent`), relayed as it was read and
        `TURN` bytes per turn of the event loop: no filter marker is in it, so the filters
        would leave it as it is, and no write holds the loop for more than that. What is still
        held stays charged (`after`: the bytes that follow the pieces)."""
        clock = self.relay.clock
        left = sum(len(p) for p in pieces)
        pieces.reverse()  # popped from the end: each read freed once it is out
        turn = 0
        while pieces:
            piece = pieces.pop()
            left -= len(piece)
            turn += len(piece)
            _keep_tail(tail, piece)
            began = clock()
            dog.writing(began)
            await sr.write(piece)
            now = clock()
            dog.reading(now, now - began)
            del piece
            if turn >= TURN or not pieces:
                turn = 0
                self.charge.shrink_to(ANSWER_COPIES * (left + after))
                await asyncio.sleep(0)  # a write the socket took whole did not give the loop a turn

    async def _end(
        self,
        up: Upstream,
        sr: web.StreamResponse,
        last: bytes,
        tail: bytes,
        strip_usage: bool,
        dog: RelayWatchdog,
    ) -> None:
        """The backend's stream ended: relay its last piece, and judge how it ended. Runs
        inside the relay's watchdog (`dog`): a last write blocked for client_write_timeout_s
        is a `Stalled` client. From here on it waits only on the client (`writing`): an error
        event that blocks is the client's stall, never the backend's silence."""
        dog.writing(self.relay.clock())
        if not up.opaque and last and not ends_an_event(last):
            # The answer ended inside an event: a close-delimited stream whose connection was
            # torn (without chunked framing the end of the body looks like its end).
            end = last_event_end(last)
            if end > 0 and not await self._write_or_give_up(sr, self._filter(last[:end], strip_usage)):
                return
            await self._broken(sr, "stream ended inside an event")
            return
        if not up.opaque and not ends_with_done(tail):
            if last and not await self._write_or_give_up(sr, self._filter(last, strip_usage)):
                return
            await self._broken(sr, "stream ended without [DONE]")
            return
        self.relay.reports.succeeded(self.ticket.backend)
        if not up.opaque:
            self._read_usage(tail)
        last = self._filter(last, strip_usage)
        if self.spec is not None:
            self.accept_length = reported_accept_length(self.spec.details, as_count(self.tokens), tail)
        began = self.relay.clock()
        await sr.write_eof(last)  # (it waits for the client to take what is buffered)
        now = self.relay.clock()
        dog.reading(now, now - began)  # that wait is the client's too (`client_blocked_s`)
        self.state.judge("ok")

    async def _broken(self, sr: web.StreamResponse, why: str) -> None:
        """The backend's stream failed after the first byte: an error, reported and ended."""
        self.state.judge("error")
        backend = self.ticket.backend
        self.relay.reports.failed(backend, why)
        await self._break(sr, f"backend {backend.name} {why}")

    async def _write_or_give_up(self, sr: web.StreamResponse, data: bytes, *, eof: bool = False) -> bool:
        """Write (and end, with `eof`) within client_write_timeout_s; False when the client was given up."""
        limit = self.relay.limits.client_write_timeout_s
        try:
            with ClockTimeout(limit, self.relay.clock):
                if eof:
                    await sr.write_eof(data)
                elif data:
                    await sr.write(data)
        except TimeoutError:
            self._client_stalled(limit)
            return False
        return True

    async def _break(self, sr: web.StreamResponse, message: str) -> None:
        log.warning("%s", message)
        try:
            if await self._write_or_give_up(sr, terminal_bytes(self.relay.identity.for_clients(message))):
                await self._write_or_give_up(sr, b"", eof=True)
        except (ConnectionResetError, aiohttp.ClientError, OSError):
            self.state.client_gone()
