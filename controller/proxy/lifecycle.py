"""The life of one routed request, from its reservation to its `Outcome`.

How it works: a `RequestLifecycle` is made in the step that decided the request and takes the
slot in `__init__`, so no path can hold a decision without a reservation. It moves through
`admitted` -> `connecting` (attempts, failover) -> `first_byte` (an answer is committed to) ->
`streaming` (bytes reached the client) -> `done`, and `finish()` -- called once, from the
handler's `finally`, on every path including cancellation -- releases the slot and the memory
charge and builds the one `Outcome`.

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
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from controller.proxy.errors import NoBackendAvailable, SpecrouteError, StreamBroken
from controller.proxy.headers import client_headers
from controller.proxy.memory import ANSWER_COPIES, Charge
from controller.proxy.native import generate_completion_tokens
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
from controller.proxy.upstream import (
    TURN,
    Attempt,
    BackendAnswered,
    BackendOverloaded,
    Upstream,
    UpstreamFailure,
    open_upstream,
)
from controller.proxy.watchdog import ClockTimeout, RelayWatchdog, Stalled
from policies.base import Decision, Outcome, OutcomeStatus, RequestInfo

if TYPE_CHECKING:
    from collections.abc import Callable

    from controller.proxy.capacity import Capacity
    from controller.proxy.config import Settings
    from controller.proxy.identity import BackendIdentity
    from controller.proxy.load import BackendState, LoadTracker
    from controller.proxy.memory import MemoryBudget
    from controller.proxy.metrics import Metrics
    from policies.base import Pool


class Forwarding(Protocol):
    """What a lifecycle needs of the forwarder that made it (`forward.Forwarder` is the one
    implementation): its shared state, and where an attempt's fate is reported. A protocol, so
    the lifecycle does not import the forwarder that imports it."""

    settings: Settings
    tracker: LoadTracker
    metrics: Metrics
    clock: Callable[[], float]
    capacity: Capacity
    budget: MemoryBudget
    identity: BackendIdentity
    session: aiohttp.ClientSession | None
    cache_reporters: set[str]
    client_timeout: aiohttp.ClientTimeout
    relays: set[RelayWatchdog]

    def response_headers(self, resp: aiohttp.ClientResponse, decision: Decision) -> CIMultiDict[str]: ...
    def attempt_failed(self, backend: BackendState, failure: UpstreamFailure, sent_at: float) -> None: ...
    def attempt_timed_out(self, backend: BackendState, sent_at: float | None, why: str) -> None: ...
    def attempt_failed_after_commit(self, backend: BackendState, why: str) -> None: ...
    def attempt_succeeded(self, backend: BackendState) -> None: ...
    def report_progress(self, backend: BackendState) -> None: ...
    def failover_target(self, failed: BackendState, tried: set[str], forced: bool) -> BackendState | None: ...
    def for_pool(
        self, pool: Pool, raw: bytes, body: dict[str, Any], headers: CIMultiDict[str]
    ) -> tuple[bytes, CIMultiDict[str]]: ...


log = logging.getLogger("specroute.forward")

State = Literal["admitted", "connecting", "first_byte", "streaming", "done"]
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


class RequestLifecycle:
    """One forwarded request (see the module's note)."""

    def __init__(
        self,
        fwd: Forwarding,
        request: web.Request,
        info: RequestInfo,
        body: dict[str, Any],
        raw: bytes,
        path: str,
        decision: Decision,
        headers: CIMultiDict[str],
        blocks: tuple[int, ...] = (),
        body_charge: Charge | None = None,
    ) -> None:
        self.fwd = fwd
        self.reservation = fwd.capacity.reserve(decision.backend, info.max_tokens or 0, blocks)
        self.state: State = "admitted"
        self.request = request
        self.info = info
        self.headers = headers
        self.body, self.raw = body, raw
        self.path = path
        self.decision = decision
        self.chosen_backend = decision.backend
        """The backend first chosen (a failover changes `decision`)."""
        self.body_charge = body_charge
        self.charge = Charge(fwd.budget)
        """The answer's bytes held (first event, whole answer, held-back bytes)."""
        self.strip_usage = False
        """specroute asked for the usage chunk on the client's behalf: it is not relayed."""
        asked = ask_for_usage(raw, body) if info.endpoint != "generate" else None  # meta_info counts
        if asked is not None:
            self.raw, self.body = asked
            self.strip_usage = True
        self.sent_at: float | None = None
        """When the request was first handed to an upstream connection."""
        self.status: OutcomeStatus = "error"
        self.http_status = 0
        self.tokens: int | None = None
        self.first_byte_at: float | None = None
        self.spec: SpecEvents | None = None
        self.accept_length: float | None = None
        self.cached_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.outcome: Outcome | None = None

    # -- the end, in one place --

    def finish(self, started: float, now: float) -> Outcome:
        """Release what the request holds and build its `Outcome` (once; later calls return it)."""
        if self.outcome is not None:
            return self.outcome
        self.state = "done"
        self.fwd.capacity.release(self.reservation)
        self.charge.release()
        if self.body_charge is not None:
            self.body_charge.release()
        ttft = None if self.first_byte_at is None else max(0.0, self.first_byte_at - started)
        self.outcome = Outcome(
            request=self.info,
            decision=self.decision,
            started_at=started,
            ttft_s=ttft,
            completion_tokens=as_count(self.tokens),
            duration_s=max(0.0, now - started),
            status=self.status,
            accept_length=self.accept_length,
            cached_tokens=as_count(self.cached_tokens),
            failed_over=self.decision.backend != self.chosen_backend,
        )
        return self.outcome

    def _read_cache_report(self, data: bytes) -> None:
        """`cached_tokens` and `prompt_tokens` from the answer's usage (or `meta_info`). SGLang
        writes `prompt_tokens_details: null` both when it reports no cache and when nothing was
        cached: after a backend has reported a number once, a null from it means 0."""
        self.prompt_tokens = reported_prompt_tokens(data)
        cached = reported_cached_tokens(data)
        reporters = self.fwd.cache_reporters
        name = self.reservation.backend.name
        if cached is not None:
            reporters.add(name)
        elif self.prompt_tokens is not None and name in reporters:
            cached = 0
        self.cached_tokens = cached

    def _count_tokens(self, data: bytes) -> None:
        if self.info.endpoint == "generate":
            self.tokens = generate_completion_tokens(data)
        else:
            self.tokens = last_count(data, b"completion_tokens")

    # -- running --

    async def run(self) -> web.StreamResponse:
        sr: web.StreamResponse | None = None
        try:
            up = await self._connect()
            # Committed: nothing is sent upstream again, so the body need not live on.
            self.raw, self.body = b"", {}
            if self.body_charge is not None:
                self.body_charge.release()
            self.state = "first_byte"
            self.fwd.report_progress(self.reservation.backend)
            if not up.streaming:
                return await self._whole(up)
            self.first_byte_at = up.first_byte_at
            sr = web.StreamResponse(
                status=up.resp.status, headers=self.fwd.response_headers(up.resp, self.decision)
            )
            return await self._relay(up, sr)
        except asyncio.CancelledError:
            # The client went away, or a shutdown cut the request: whatever it did not read
            # must not keep its connection (and buffer) alive.
            self.status = "client_closed"
            await self._cut(sr)
            abort(self.request)
            raise

    async def _cut(self, sr: web.StreamResponse | None) -> None:
        """A cancelled stream that reached the client: end it with the error event if it can
        be written at once (a shutdown's drain timeout cut it; a gone client cannot read it)."""
        transport = self.request.transport
        if sr is None or not sr.prepared or transport is None or transport.is_closing():
            return
        try:
            with ClockTimeout(CUT_WRITE_S, self.fwd.clock):
                await sr.write(terminal_bytes("stream cut: specroute is shutting down"))  # names no backend
                await sr.write_eof()
        except BaseException:
            pass

    def _attempt(self, data: bytes, hdrs: CIMultiDict[str]) -> Attempt:
        s = self.fwd.settings
        backend = self.reservation.backend
        return Attempt(
            url=backend.url + self.path,
            name=backend.name,
            data=data,
            headers=hdrs,
            stream=self.info.stream,
            timeout_s=s.first_byte_timeout_s if self.info.stream else s.request_timeout_s,
            limit=s.response_limit_bytes,
            budget_wait_s=s.admission_wait_s,
        )

    async def _try(self) -> Upstream:
        fwd = self.fwd
        backend = self.reservation.backend
        data, hdrs = fwd.for_pool(backend.pool, self.raw, self.body, self.headers)
        self.spec = None
        # /generate is left alone: its meta_info has no sglext member to ask for and strip.
        if fwd.settings.spec_details and backend.pool == "eagle" and self.info.endpoint != "generate":
            asked = ask_for_spec_details(data, self.body)
            self.spec = SpecEvents(strip=asked is not None)
            data = asked or data
        if self.sent_at is None:
            self.sent_at = fwd.clock()
        assert fwd.session is not None, "the app's cleanup_ctx has not started"
        return await open_upstream(
            fwd.session, self._attempt(data, hdrs), fwd.client_timeout, self.charge, fwd.clock
        )

    async def _connect(self) -> Upstream:
        fwd = self.fwd
        tried: set[str] = set()
        self.state = "connecting"
        error: SpecrouteError | None = None
        while True:
            backend = self.reservation.backend
            tried.add(backend.name)
            attempt_sent = fwd.clock()
            try:
                return await self._try()
            except UpstreamFailure as f:
                self.charge.release()
                fwd.attempt_failed(backend, f, attempt_sent)
                alt = None
                if f.may_retry and len(tried) < 2:
                    alt = fwd.failover_target(backend, tried, self.info.forced_pool is not None)
                if alt is None:
                    error = self._give_up(f, tried)
            if alt is None:
                # Raised here, not in the `except`: there the failure would become the error's
                # context while it holds the error (`failure.error`), a cycle keeping every frame
                # of the attempt, the backend's buffered bytes with them, until the cyclic GC ran
                # (`benchmarks/hostile_bodies.py`, row H: ~1 MB per refused answer held).
                assert error is not None
                try:
                    raise error
                finally:
                    error = None
            fwd.metrics.failover(backend.pool)
            self.reservation = fwd.capacity.move(self.reservation, alt.name)
            self.decision = replace(self.decision, pool=alt.pool, backend=alt.name, reason="failover")

    def _give_up(self, failure: UpstreamFailure, tried: set[str]) -> SpecrouteError:
        self.status = "timeout" if failure.kind == "timeout" else "error"
        error = failure.error
        fwd = self.fwd
        if failure.kind == "unreachable" and all(b.name in tried for b in fwd.tracker.usable(fwd.clock())):
            # Every backend is down (this request just found the last one refusing): that is
            # "no healthy backend", the same answer later requests get at once.
            error = NoBackendAvailable(f"no healthy backend ({failure.error.message})")
        self.http_status = error.status
        if isinstance(error, BackendAnswered | BackendOverloaded):  # the backend's answer: say whose
            self.http_status = getattr(error, "backend_status", error.status)
            shown = client_headers({}, self.decision, show_backend=fwd.settings.backend_header)
            error.headers.update(shown)
        return error

    async def _whole(self, up: Upstream) -> web.StreamResponse:
        resp = up.resp
        self.http_status = resp.status
        self.status = "ok" if resp.status < 400 else "client_error"
        self.fwd.attempt_succeeded(self.reservation.backend)
        body = up.head
        if resp.status == 200:
            self._count_tokens(body)
            self._read_cache_report(body)
            if self.spec is not None:
                stripped, details = drop_sglext_member(body)
                self.accept_length = reported_accept_length(details, as_count(self.tokens), body)
                if self.spec.strip_event:
                    body = stripped
        headers = self.fwd.response_headers(resp, self.decision)
        if resp.status >= 400:
            headers["Content-Type"] = "application/json"
        out = web.Response(status=resp.status, body=body, headers=headers)
        resp.release()
        # Written here, not by aiohttp after the handler returns, so a client that does not read
        # is given up after client_write_timeout_s instead of holding its connection forever.
        limit = self.fwd.settings.client_write_timeout_s
        try:
            with ClockTimeout(limit, self.fwd.clock):
                await out.prepare(self.request)
                await out.write_eof()
        except TimeoutError:
            self._client_stalled(limit)
        except ConnectionResetError:
            self.status = "client_closed"
        return out

    def _client_stalled(self, seconds: float) -> None:
        log.info(
            "client of a request to %s took nothing for %g s: answer given up", self.decision.backend, seconds
        )
        self.status = "client_closed"
        self.fwd.metrics.client_stalls.inc()
        abort(self.request)

    def _filter(self, chunk: bytes, strip_usage: bool) -> bytes:
        if strip_usage:
            chunk = drop_usage_events(chunk)
        if self.spec is not None:
            chunk = self.spec.strip(chunk)
        return chunk

    async def _relay(self, up: Upstream, sr: web.StreamResponse) -> web.StreamResponse:
        resp = up.resp
        self.http_status = resp.status
        clean = False
        try:
            await sr.prepare(self.request)
            self.state = "streaming"
            clean = await self._pump(up, sr)
        except ConnectionResetError:
            self.status = "client_closed"
        except Exception as e:  # a bug must not put a second response inside this one
            log.exception("relaying a stream from %s failed", self.decision.backend)
            self.status = "error"
            await self._break(sr, f"specroute failed relaying the stream: {type(e).__name__}")
        finally:
            if clean:
                resp.release()
            else:
                resp.close()  # the backend sees the disconnect and aborts the generation
        return sr

    async def _pump(self, up: Upstream, sr: web.StreamResponse) -> bool:
        """Relay the stream to its end; True when it ended as the backend meant (read whole)."""
        strip_usage = self.strip_usage and not up.opaque
        settings = self.fwd.settings
        content = up.resp.content
        clock = self.fwd.clock
        tail = [b"", b"", b""]
        held = Holdback()
        charge, spec = self.charge, self.spec
        chunk = up.head
        try:
            with RelayWatchdog(
                settings.idle_timeout_s, settings.client_write_timeout_s, clock, self.fwd.relays
            ) as dog:
                if up.pieces:
                    await self._relay_pieces(up.pieces, sr, dog, tail, len(chunk))
                    if not chunk and not (up.ended or content.at_eof()):
                        chunk = await content.readany()
                while chunk:
                    if len(chunk) <= TAIL_BYTES:  # `_keep_tail`, inline: once per chunk of every stream
                        tail[0], tail[1], tail[2] = tail[1], tail[2], chunk
                    else:
                        tail[0], tail[1], tail[2] = b"", b"", chunk[-TAIL_BYTES:]
                    if up.ended or content.at_eof():
                        break  # the last piece goes out with the terminating chunk, in one write
                    if not up.opaque:
                        chunk = held.push(chunk)
                        if held.pending and not charge.grow_to(len(held.pending)):
                            await self._broken(sr, "an unfinished event does not fit in the memory budget")
                            return False
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
                return await self._end(up, sr, held.rest() + chunk, b"".join(tail), strip_usage, dog)
        except Stalled as e:
            if e.side == "client":
                self._client_stalled(e.seconds)
                return False
            self.status = "timeout"
            self.fwd.attempt_timed_out(self.reservation.backend, self.sent_at, f"silent for {e.seconds:g} s")
            await self._break(sr, f"backend {self.decision.backend} sent nothing for {e.seconds:g} s")
            return False
        except (aiohttp.ClientError, OSError) as e:
            transport = self.request.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError from None  # our own client went away (write failed)
            await self._broken(sr, f"stream broke: {type(e).__name__}")
            return False

    async def _relay_pieces(
        self, pieces: list[bytes], sr: web.StreamResponse, dog: RelayWatchdog, tail: list[bytes], after: int
    ) -> None:
        """A first event larger than `PIECE` (`upstream.FirstEvent`), relayed as it was read and
        `TURN` bytes per turn of the event loop: no filter marker is in it, so the filters
        would leave it as it is, and no write holds the loop for more than that. What is still
        held stays charged (`after`: the bytes that follow the pieces)."""
        clock = self.fwd.clock
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
    ) -> bool:
        """The backend's stream ended: relay its last piece, and judge how it ended. Runs
        inside the relay's watchdog (`dog`): a last write blocked for client_write_timeout_s
        is a `Stalled` client. From here on it waits only on the client (`writing`): an error
        event that blocks is the client's stall, never the backend's silence."""
        dog.writing(self.fwd.clock())
        if not up.opaque and last and not ends_an_event(last):
            # The answer ended inside an event: a close-delimited stream whose connection was
            # torn (without chunked framing the end of the body looks like its end).
            end = last_event_end(last)
            if end > 0 and not await self._write_or_give_up(sr, self._filter(last[:end], strip_usage)):
                return False
            await self._broken(sr, "stream ended inside an event")
            return False
        if not up.opaque and not ends_with_done(tail):
            if last and not await self._write_or_give_up(sr, self._filter(last, strip_usage)):
                return False
            await self._broken(sr, "stream ended without [DONE]")
            return False
        self.status = "ok"
        self.fwd.attempt_succeeded(self.reservation.backend)
        if not up.opaque:
            self._count_tokens(tail)
            if up.resp.status == 200:
                self._read_cache_report(tail)
        last = self._filter(last, strip_usage)
        if self.spec is not None:
            self.accept_length = reported_accept_length(self.spec.details, as_count(self.tokens), tail)
        await sr.write_eof(last)
        return True

    async def _broken(self, sr: web.StreamResponse, why: str) -> None:
        """The backend's stream failed after the first byte: an error, reported and ended."""
        self.status = "error"
        self.fwd.attempt_failed_after_commit(self.reservation.backend, why)
        await self._break(sr, f"backend {self.decision.backend} {why}")

    async def _write_or_give_up(self, sr: web.StreamResponse, data: bytes, *, eof: bool = False) -> bool:
        """Write (and end, with `eof`) within client_write_timeout_s; False when the client was given up."""
        limit = self.fwd.settings.client_write_timeout_s
        try:
            with ClockTimeout(limit, self.fwd.clock):
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
            if await self._write_or_give_up(sr, terminal_bytes(self.fwd.identity.for_clients(message))):
                await self._write_or_give_up(sr, b"", eof=True)
        except (ConnectionResetError, aiohttp.ClientError, OSError):
            self.status = "client_closed"
