"""Forward one completion request to the chosen backend and relay its answer.

How it works:
1. Parse the body once (bad input -> 400), build a `RequestInfo`, take a `LoadView`, ask the
   routing core (`policies.routing.Router`: `x-specroute-mode`, the policy, the backend within
   the pool, the fallback) and `reserve` the backend -- one synchronous step.
2. Open the upstream request. Before committing to it, read the first SSE event of a stream
   (or the whole body of a non-streaming answer): connection refused, a timeout, a 5xx, or
   SGLang's queue-full event (HTTP 200, first event `{"error": {... "code": 503}}`) is retried
   ONCE on another healthy backend (same pool first, then the other pool; a forced pool is
   kept). Refused/timed-out backends are marked unhealthy until a health probe succeeds.
3. Relay bytes unchanged as they arrive. Nothing is retried once a byte reached the client; a
   stream that dies or idles out afterwards ends with an OpenAI-shaped SSE error and `[DONE]`.
4. `finally` (every path, including client disconnect = handler cancellation): close the
   upstream response unless it was read to its end (so SGLang aborts), release the
   reservation, feed `Outcome` to the policy that chose the request (and to the shadow
   policies, which were asked right after the live decision with the same inputs), count
   metrics, notify observers (decision log).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from controller.proxy.config import Settings
from controller.proxy.errors import (
    BackendFailed,
    BackendTimeout,
    BadRequest,
    NoBackendAvailable,
    RequestTimeout,
    SpecrouteError,
    StreamBroken,
)
from controller.proxy.load import BackendState, LoadTracker, Reservation
from controller.proxy.metrics import Metrics
from controller.proxy.shadow import ShadowChoice, ShadowPolicies
from controller.proxy.spec_details import (
    SpecEvents,
    accept_length,
    ask_for_spec_details,
    drop_sglext_member,
    event_span,
)
from policies.base import (
    Decision,
    EndpointKind,
    InvalidDecision,
    LoadView,
    NoHealthyBackend,
    Outcome,
    OutcomeStatus,
    Policy,
    Pool,
    RequestInfo,
    parse_pool,
)
from policies.routing import Router

log = logging.getLogger("specroute.forward")

MODE_HEADER = "x-specroute-mode"
HINT_HEADER = "x-specroute-hint"
_HINT_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
_USAGE_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_MAX_HELD_BACK = 1 << 16  # bytes of an unfinished SSE event held back before relaying anyway
_REQUEST_DROP = frozenset(
    {
        "host", "content-length", "connection", "keep-alive", "proxy-authorization", "proxy-connection",
        "te", "trailer", "transfer-encoding", "upgrade", "accept-encoding", "expect", "content-encoding",
        MODE_HEADER, HINT_HEADER,
    }
)  # fmt: skip
_RESPONSE_DROP = frozenset(
    {
        "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade", "trailer",
        "date", "server", "content-encoding",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """Everything observers (decision log, shadow policies) get once a request has ended."""

    request: RequestInfo
    view: LoadView
    decision: Decision
    """The final decision (after a failover, the backend that actually served)."""
    chosen: Decision
    """What the policy (or the client override) originally decided."""
    outcome: Outcome
    http_status: int
    policy: Policy
    shadow: tuple[ShadowChoice, ...] = ()
    """What each shadow policy chose for this request (same inputs as `chosen`)."""
    arrived_at: float | None = None
    """When the handler started (the proxy's clock); `outcome.started_at` is the decision."""


Observer = Callable[[RequestRecord], None]


# --- request parsing --------------------------------------------------------------------


def parse_body(raw: bytes, endpoint: EndpointKind) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if endpoint == "chat":
        if not isinstance(body.get("messages"), list):
            raise BadRequest("'messages' is required and must be a list")
    elif "prompt" not in body:
        raise BadRequest("'prompt' is required")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest("'stream' must be a boolean")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None:
            continue
        integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not integral or not 0 <= value < 2**53:
            raise BadRequest(f"'{key}' must be a non-negative integer")
    return body


def _text_len(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        total = 0
        for part in value:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, dict):
                text = part.get("text")
                total += len(text) if isinstance(text, str) else 0
            elif isinstance(part, int):
                total += 4  # a token id
            elif isinstance(part, list):  # a batch of prompts; deeper nesting is not counted
                total += sum(4 if isinstance(x, int) else len(x) if isinstance(x, str) else 0 for x in part)
        return total
    return 0


def estimate_prompt_tokens(body: Mapping[str, Any], endpoint: EndpointKind) -> int:
    """Cheap estimate: characters / 4."""
    if endpoint == "chat":
        chars = sum(_text_len(m.get("content")) for m in body["messages"] if isinstance(m, dict))
    else:
        chars = _text_len(body.get("prompt"))
    return chars // 4


def request_info(
    body: Mapping[str, Any], endpoint: EndpointKind, headers: Mapping[str, str], allow_override: bool
) -> RequestInfo:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        max_tokens = None
    forced: Pool | None = None
    mode = headers.get(MODE_HEADER)
    if mode is not None and allow_override:
        try:
            forced = parse_pool(mode.strip().lower())
        except ValueError:
            raise BadRequest(f"{MODE_HEADER} must be 'baseline' or 'eagle', got {mode[:40]!r}") from None
    hint = headers.get(HINT_HEADER)
    if hint is not None and not _HINT_RE.fullmatch(hint):
        hint = None
    return RequestInfo(
        endpoint=endpoint,
        stream=body.get("stream") is True,
        prompt_tokens=estimate_prompt_tokens(body, endpoint),
        max_tokens=max_tokens,
        hint=hint,
        forced_pool=forced,
    )


# --- upstream answers -------------------------------------------------------------------


class UpstreamFailure(Exception):
    """The backend failed before anything was committed to the client."""

    def __init__(self, error: SpecrouteError, *, mark_unhealthy: bool, timeout: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.mark_unhealthy = mark_unhealthy
        self.timeout = timeout


@dataclass(slots=True)
class Upstream:
    resp: aiohttp.ClientResponse
    head: bytes
    """Streams: the bytes up to the end of the first event. Otherwise: the whole body."""
    streaming: bool
    retryable: bool
    first_byte_at: float | None


def _first_event_is_error(head: bytes) -> bool:
    """SGLang's queue-full (or other server-side) error sent as the first SSE event."""
    end = head.find(b"\n\n")
    first = head if end < 0 else head[:end]
    if b'"error"' not in first:
        return False
    line = first.strip()
    if not line.startswith(b"data:"):
        return False
    try:
        obj = json.loads(line[5:])
    except ValueError:
        return False
    if not isinstance(obj, dict) or not isinstance(obj.get("error"), dict):
        return False
    code = obj["error"].get("code")
    try:
        return code is None or int(code) >= 500
    except (TypeError, ValueError):
        return True


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


def drop_usage_events(data: bytes) -> bytes:
    """`data` (whole SSE events) without the usage event (`choices: []` and a usage object) that
    specroute asked for on the client's behalf; every other byte unchanged. Only the events around
    a `"choices":[]` are looked at (one per stream), so the usual chunk costs two scans."""
    for marker in (b'"choices":[]', b'"choices": []'):
        at = data.find(marker)
        while at >= 0:
            begin, stop = event_span(data, at)
            event = data[begin:stop].strip()
            obj = None
            if event.startswith(b"data:") and b'"usage"' in event:
                try:
                    obj = json.loads(event[5:])
                except ValueError:
                    pass
            if isinstance(obj, dict) and obj.get("choices") == [] and isinstance(obj.get("usage"), dict):
                data = data[:begin] + data[stop:]
                at = data.find(marker, begin)
            else:
                at = data.find(marker, stop)
    return data


def completion_tokens(data: bytes) -> int | None:
    found = _USAGE_RE.findall(data)
    return int(found[-1]) if found else None


def response_headers(resp: aiohttp.ClientResponse, decision: Decision) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in resp.headers.items():
        if key.lower() not in _RESPONSE_DROP:
            out.add(key, value)
    out["x-specroute-pool"] = decision.pool
    out["x-specroute-backend"] = decision.backend
    out["x-specroute-reason"] = decision.reason
    return out


class Forwarder:
    """Routes and forwards completion requests. `policy` may be swapped at any time (hot reload):
    each request keeps the policy object that chose it."""

    def __init__(
        self,
        settings: Settings,
        policy: Policy,
        tracker: LoadTracker,
        metrics: Metrics,
        *,
        clock: Callable[[], float],
        observers: list[Observer] | None = None,
        shadows: ShadowPolicies | None = None,
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.tracker = tracker
        self.metrics = metrics
        self.clock = clock
        self.observers: list[Observer] = observers if observers is not None else []
        self.shadows = shadows if shadows else None
        self.session: aiohttp.ClientSession | None = None
        self.router = Router(settings.seed)
        """The routing core (`policies.routing`): override, fallback, backend choice, failover."""
        self.client_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout_s, connect=None, sock_read=None
        )
        self._model: dict[str, str | None] = {
            "baseline": settings.baseline_model,
            "eagle": settings.eagle_model,
        }
        self._auth: dict[str, str | None] = {
            pool: f"Bearer {key.get_secret_value()}" if key is not None else None
            for pool, key in (("baseline", settings.baseline_api_key), ("eagle", settings.eagle_api_key))
        }

    def auth_header(self, pool: Pool) -> str | None:
        """The Authorization header configured for `pool` (None: forward the client's)."""
        return self._auth[pool]

    # -- deciding --

    def decide(self, policy: Policy, info: RequestInfo, view: LoadView, now: float) -> Decision:
        """The routing core's decision, its errors translated into HTTP ones."""
        try:
            return self.router.decide(policy, info, view, now)
        except NoHealthyBackend as e:
            raise NoBackendAvailable(str(e)) from None
        except InvalidDecision as e:
            raise SpecrouteError(f"routing policy {policy.name!r} {e}") from None
        except Exception:
            log.exception("policy %r failed in choose()", policy.name)
            raise SpecrouteError(f"routing policy {policy.name!r} failed") from None

    def failover_target(self, failed: BackendState, tried: set[str], forced: bool) -> BackendState | None:
        alt = self.router.failover(self.tracker.view(self.clock()), failed.name, tried, forced)
        return None if alt is None else self.tracker.get(alt.name)

    # -- forwarding --

    def _upstream_headers(self, headers: Mapping[str, str]) -> CIMultiDict[str]:
        out: CIMultiDict[str] = CIMultiDict()
        for key, value in headers.items():
            if key.lower() not in _REQUEST_DROP:
                out.add(key, value)
        return out

    def _for_pool(
        self, pool: Pool, raw: bytes, body: dict[str, Any], headers: CIMultiDict[str]
    ) -> tuple[bytes, CIMultiDict[str]]:
        model = self._model[pool]
        if model is not None:
            raw = json.dumps({**body, "model": model}).encode()
        auth = self._auth[pool]
        if auth is not None:
            headers = headers.copy()
            headers["Authorization"] = auth
        return raw, headers

    async def open(self, url: str, data: bytes, headers: CIMultiDict[str], stream: bool) -> Upstream:
        assert self.session is not None, "the app's cleanup_ctx has not started"
        resp: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(self.settings.first_byte_timeout_s):
                resp = await self.session.post(url, data=data, headers=headers, timeout=self.client_timeout)
                if stream and resp.status == 200:
                    head = b""
                    while b"\n\n" not in head and b"\r\n\r\n" not in head:
                        chunk = await resp.content.readany()
                        if not chunk:
                            break
                        head += chunk
                    first_byte_at = self.clock()
                    if not resp.content.at_eof():
                        head += resp.content.read_nowait()  # what is already buffered: one write, not two
                    return Upstream(resp, head, True, _first_event_is_error(head), first_byte_at)
                body = await resp.read()
                return Upstream(resp, body, False, resp.status >= 500, self.clock())
        except BaseException as e:
            if resp is not None:
                resp.close()
            if isinstance(e, aiohttp.ConnectionTimeoutError):
                # The host never completed the TCP handshake: unreachable, like a refusal.
                raise UpstreamFailure(
                    BackendFailed(f"backend {url} did not accept the connection in time"),
                    mark_unhealthy=True,
                    timeout=False,
                ) from None
            if isinstance(e, TimeoutError):
                raise UpstreamFailure(
                    BackendTimeout(f"backend {url} timed out before the first byte"),
                    mark_unhealthy=True,
                    timeout=True,
                ) from None
            if isinstance(e, aiohttp.ClientConnectorError):
                raise UpstreamFailure(
                    BackendFailed(f"backend {url} refused the connection: {e.os_error}"),
                    mark_unhealthy=True,
                    timeout=False,
                ) from None
            if isinstance(e, aiohttp.ClientError | OSError):
                raise UpstreamFailure(
                    BackendFailed(f"backend {url} failed before the first byte: {type(e).__name__}"),
                    mark_unhealthy=False,
                    timeout=False,
                ) from None
            raise

    async def handle(self, request: web.Request, endpoint: EndpointKind, path: str) -> web.StreamResponse:
        arrived = self.clock()
        try:
            if request.content.is_eof():  # the usual case: the body came with the headers
                raw = await request.read()
            else:
                try:
                    async with asyncio.timeout(self.settings.body_timeout_s):
                        raw = await request.read()
                except TimeoutError:
                    raise RequestTimeout(
                        f"request body not received within {self.settings.body_timeout_s:g} s"
                    ) from None
            body = parse_body(raw, endpoint)
            info = request_info(body, endpoint, request.headers, self.settings.allow_client_override)
            if self.settings.log_bodies:
                log.info("request %s %s", path, raw[:65536].decode(errors="replace"))
            policy = self.policy
            started = self.clock()
            view = self.tracker.view(started)
            chosen = self.decide(policy, info, view, started)
        except SpecrouteError as e:
            self.metrics.reject(e.status)
            raise
        except web.HTTPRequestEntityTooLarge:
            self.metrics.reject(413)
            raise
        # Same synchronous step as the decision: no await between choose() and reserve().
        run = _Run(self, request, info, body, raw, path, chosen)
        run.reservation = self.tracker.reserve(chosen.backend, info.max_tokens or 0)
        try:
            self.metrics.decision(policy.name, chosen.pool, chosen.reason)
            if self.shadows is not None:
                run.shadow = self.shadows.decide(info, view, started, chosen)
            return await run.execute()
        finally:
            self.tracker.release(run.reservation)
            ended = self.clock()
            ttft = None if run.first_byte_at is None else max(0.0, run.first_byte_at - started)
            outcome = Outcome(
                request=info,
                decision=run.decision,
                started_at=started,
                ttft_s=ttft,
                completion_tokens=run.tokens,
                duration_s=max(0.0, ended - started),
                status=run.status,
                accept_length=run.accept_length,
            )
            try:
                policy.observe(outcome)
            except Exception:
                log.exception("policy %r failed in observe()", policy.name)
            if self.shadows is not None:
                self.shadows.observe(outcome)
            metrics = self.metrics
            metrics.request_done(run.decision.pool, run.decision.backend, run.status)
            metrics.outcome(policy.name, outcome)
            if run.sent_at is not None:
                metrics.proxy_overhead(max(0.0, run.sent_at - arrived))
            if self.observers:
                record = RequestRecord(
                    info, view, run.decision, chosen, outcome, run.http_status, policy, run.shadow, arrived
                )
                for observer in self.observers:
                    try:
                        observer(record)
                    except Exception:
                        log.exception("request observer failed")


class _Run:
    """The mutable state of one forwarded request (what `finally` needs to know)."""

    def __init__(
        self,
        fwd: Forwarder,
        request: web.Request,
        info: RequestInfo,
        body: dict[str, Any],
        raw: bytes,
        path: str,
        decision: Decision,
    ) -> None:
        self.fwd = fwd
        self.request = request
        self.info = info
        self.body = body
        self.raw = raw
        self.strip_usage = False
        """specroute asked for the usage chunk on the client's behalf: it is not relayed."""
        asked = ask_for_usage(raw, body)
        if asked is not None:
            self.raw, self.body = asked
            self.strip_usage = True
        self.path = path
        self.decision = decision
        self.reservation: Reservation  # set by the caller right after the decision, before any await
        self.shadow: tuple[ShadowChoice, ...] = ()
        self.sent_at: float | None = None
        """When the request was first handed to an upstream connection."""
        self.status: OutcomeStatus = "error"
        self.http_status = 0
        self.tokens: int | None = None
        self.first_byte_at: float | None = None
        self.spec: SpecEvents | None = None
        """Set while the backend is an eagle one and `spec_details` is on (see spec_details.py)."""
        self.accept_length: float | None = None

    async def execute(self) -> web.StreamResponse:
        try:
            up = await self._connect()
            self.first_byte_at = up.first_byte_at if up.streaming else None
            if not up.streaming:
                return self._whole(up)
            return await self._relay(up)
        except asyncio.CancelledError:
            self.status = "client_closed"
            raise

    async def _connect(self) -> Upstream:
        fwd = self.fwd
        headers = fwd._upstream_headers(self.request.headers)
        tried: set[str] = set()
        failure: UpstreamFailure | None = None
        while True:
            backend = self.reservation.backend
            tried.add(backend.name)
            data, hdrs = fwd._for_pool(backend.pool, self.raw, self.body, headers)
            self.spec = None
            if fwd.settings.spec_details and backend.pool == "eagle":
                asked = ask_for_spec_details(data, self.body)
                self.spec = SpecEvents(strip=asked is not None)
                data = asked or data
            up: Upstream | None = None
            if self.sent_at is None:
                self.sent_at = fwd.clock()
            try:
                up = await fwd.open(backend.name + self.path, data, hdrs, self.info.stream)
            except UpstreamFailure as f:
                if f.mark_unhealthy and fwd.tracker.set_healthy(backend.name, False):
                    log.warning("backend %s marked unhealthy: %s", backend.name, f.error.message)
                failure = f
            else:
                if not up.retryable:
                    return up
            alt = None
            if len(tried) < 2:
                alt = fwd.failover_target(backend, tried, self.info.forced_pool is not None)
            if alt is None:
                if up is not None:
                    return up  # relay the backend's own error as it sent it
                assert failure is not None
                self.status = "timeout" if failure.timeout else "error"
                error: SpecrouteError = failure.error
                if failure.mark_unhealthy and not failure.timeout and not fwd.tracker.any_healthy():
                    # Every backend is down (this request just found the last one refusing):
                    # that is "no healthy backend", the same answer later requests get at once.
                    error = NoBackendAvailable(f"no healthy backend ({failure.error.message})")
                self.http_status = error.status
                raise error
            if up is not None:
                up.resp.close()
            fwd.metrics.failover(backend.pool)
            self.reservation = fwd.tracker.move(self.reservation, alt.name)
            self.decision = replace(self.decision, pool=alt.pool, backend=alt.name, reason="failover")

    def _whole(self, up: Upstream) -> web.Response:
        resp = up.resp
        self.http_status = resp.status
        self.status = "ok" if resp.status < 400 else "error"
        body = up.head
        if resp.status == 200:
            self.tokens = completion_tokens(body)
            if self.spec is not None:
                stripped, details = drop_sglext_member(body)
                self.accept_length = accept_length(details, self.tokens)
                if self.spec.strip_event:
                    body = stripped
        return web.Response(status=resp.status, body=body, headers=response_headers(resp, self.decision))

    async def _relay(self, up: Upstream) -> web.StreamResponse:
        resp = up.resp
        fwd = self.fwd
        clean = False
        sr = web.StreamResponse(status=resp.status, headers=response_headers(resp, self.decision))
        self.http_status = resp.status
        try:
            await sr.prepare(self.request)
            tail = [b"", b"", b""]
            content = resp.content
            loop = asyncio.get_running_loop()
            idle = fwd.settings.idle_timeout_s
            # Re-arming the timer per chunk would cost a timer each: it is re-armed at most every
            # `slack` seconds, to `idle + slack` ahead, so a silence shorter than `idle` is never cut
            # (and a longer one is cut at the latest `idle + slack` after the last chunk).
            slack = idle / 8
            last = loop.time()
            chunk = up.head
            # Bytes after the last complete SSE event are held back until the event is whole, so
            # an error event sent after a break never lands inside a torn one. SGLang writes whole
            # events, so this is normally empty; it is bounded in case a backend never sends "\n\n".
            pending = b""
            try:
                async with asyncio.timeout_at(last + idle + slack) as timer:
                    while chunk:
                        tail[0], tail[1], tail[2] = tail[1], tail[2], chunk
                        if content.at_eof():
                            break  # the last piece goes out with the terminating chunk, in one write
                        if pending:
                            chunk, pending = pending + chunk, b""
                        if not chunk.endswith(b"\n\n") and len(chunk) < _MAX_HELD_BACK:
                            end = chunk.rfind(b"\n\n") + 2
                            if end == 1:  # not one event in it is complete yet
                                end = 0
                            chunk, pending = chunk[:end], chunk[end:]
                        if self.strip_usage:
                            chunk = drop_usage_events(chunk)
                        if self.spec is not None:
                            chunk = self.spec.strip(chunk)
                        if chunk:
                            await sr.write(chunk)
                        chunk = await content.readany()
                        now = loop.time()
                        if now - last >= slack:
                            timer.reschedule(now + idle + slack)
                            last = now
            except TimeoutError:
                self.status = "timeout"
                await self._break(sr, f"backend {self.decision.backend} sent nothing for {idle:g} s")
                return sr
            except (aiohttp.ClientError, OSError) as e:
                transport = self.request.transport
                if transport is None or transport.is_closing():
                    raise ConnectionResetError from None  # our own client went away (write failed)
                self.status = "error"
                await self._break(sr, f"backend {self.decision.backend} stream broke: {type(e).__name__}")
                return sr
            clean = True
            self.status = "ok" if resp.status < 400 and not up.retryable else "error"
            self.tokens = completion_tokens(b"".join(tail))
            last_piece = pending + chunk
            if self.strip_usage:
                last_piece = drop_usage_events(last_piece)
            if self.spec is not None:
                last_piece = self.spec.strip(last_piece)
                self.accept_length = accept_length(self.spec.details, self.tokens)
            await sr.write_eof(last_piece)
            return sr
        except ConnectionResetError:
            self.status = "client_closed"
            return sr
        finally:
            if clean:
                resp.release()
            else:
                resp.close()  # the backend sees the disconnect and aborts the generation

    async def _break(self, sr: web.StreamResponse, message: str) -> None:
        log.warning("%s", message)
        try:
            await sr.write(StreamBroken(message).sse_event())
            await sr.write_eof()
        except ConnectionResetError:
            self.status = "client_closed"
