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

Bounds (see `limits.py`, `watchdog.py`, `admission.py`, `outlier.py`): the body is read within
byte and JSON-structure budgets; when every backend the request may use is at its in-flight
bound it waits (bounded) for a slot, then 429; a backend's first event and non-streaming body
are read up to `response_limit_bytes` (else 502); redirects and 1xx answers are not followed
but answered 502; a stream is cut when the backend is silent for `idle_timeout_s` or a write to
the client blocks for `client_write_timeout_s`, and a stream given up aborts the client's
connection (its unsent buffer would otherwise live on); every attempt's fate goes to the
outlier detector.

SGLang's native `/generate` takes the same path; what differs in its body, its token count and
its queue-full answer is read by `controller.proxy.native`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from controller.proxy.admission import Admission
from controller.proxy.config import Settings
from controller.proxy.errors import (
    BackendFailed,
    BackendTimeout,
    BadRequest,
    NoBackendAvailable,
    SpecrouteError,
    StreamBroken,
)
from controller.proxy.headers import HINT_HEADER, MODE_HEADER, client_headers, upstream_headers
from controller.proxy.identity import BackendIdentity
from controller.proxy.limits import (
    JsonBudget,
    ResponseTooLarge,
    load_json,
    read_body,
    read_bounded,
    read_first_event,
)
from controller.proxy.load import BackendState, LoadTracker, Reservation
from controller.proxy.metrics import Metrics
from controller.proxy.native import (
    check_generate_body,
    failed_first_output,
    generate_completion_tokens,
    generate_max_tokens,
    generate_prompt_chars,
)
from controller.proxy.outlier import OutlierDetector
from controller.proxy.prefixes import (
    last_count,
    prompt_blocks,
    reported_cached_tokens,
    reported_prompt_tokens,
)
from controller.proxy.shadow import ShadowChoice, ShadowPolicies
from controller.proxy.spec_details import (
    SpecEvents,
    accept_length,
    ask_for_spec_details,
    drop_sglext_member,
    event_span,
)
from controller.proxy.watchdog import RelayWatchdog, Stalled
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
from policies.features import extract_features
from policies.routing import Router

log = logging.getLogger("specroute.forward")

_HINT_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
_MAX_HELD_BACK = 1 << 16  # bytes of an unfinished SSE event held back before relaying anyway
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")


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
    body = load_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if endpoint == "generate":
        check_generate_body(body)
    elif endpoint == "chat":
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
    if endpoint == "generate":
        chars = generate_prompt_chars(body)
    elif endpoint == "chat":
        chars = sum(_text_len(m.get("content")) for m in body["messages"] if isinstance(m, dict))
    else:
        chars = _text_len(body.get("prompt"))
    return chars // 4


def request_info(
    body: Mapping[str, Any], endpoint: EndpointKind, headers: Mapping[str, str], allow_override: bool
) -> RequestInfo:
    if endpoint == "generate":
        max_tokens = generate_max_tokens(body)
    else:
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
        features=extract_features(body, endpoint),
    )


# --- upstream answers -------------------------------------------------------------------


class UpstreamFailure(Exception):
    """The backend failed before anything was committed to the client."""

    def __init__(self, error: SpecrouteError, *, unreachable: bool, timeout: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.unreachable = unreachable
        """No connection could be made (refused, or no handshake within connect_timeout_s)."""
        self.timeout = timeout


@dataclass(slots=True)
class Upstream:
    resp: aiohttp.ClientResponse
    head: bytes
    """Streams: the bytes up to the end of the first event. Otherwise: the whole body."""
    streaming: bool
    retryable: bool
    first_byte_at: float | None
    opaque: bool = False
    """A compressed stream: relayed byte for byte, its events not looked at."""


def _first_event_is_error(head: bytes) -> bool:
    """SGLang's queue-full (or other server-side) error sent as the first SSE event."""
    end = head.find(b"\n\n")
    first = head if end < 0 else head[:end]
    if b'"error"' not in first:
        return failed_first_output(first)  # `/generate`: queue full is an abort output
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


def completion_tokens(data: bytes, endpoint: EndpointKind = "chat") -> int | None:
    if endpoint == "generate":
        return generate_completion_tokens(data)
    return last_count(data, b"completion_tokens")


def _os_reason(e: OSError) -> str:
    """Why a connect failed, without the address (the backend's name is shown instead)."""
    return os.strerror(e.errno) if e.errno else type(e).__name__


def _ends_an_event(data: bytes) -> bool:
    return data.endswith(_EVENT_ENDS)


def _abort(request: web.Request) -> None:
    """Drop the client's connection now: `close()` would wait to flush what it does not read."""
    transport = request.transport
    if transport is not None:
        transport.abort()


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
        outlier: OutlierDetector | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.tracker = tracker
        self.metrics = metrics
        self.clock = clock
        self.outlier = outlier
        self.admission = admission
        self.active: set[asyncio.Task[Any]] = set()
        """The handler tasks of requests in progress (a shutdown cancels those left after draining)."""
        self.observers: list[Observer] = observers if observers is not None else []
        self.shadows = shadows if shadows else None
        self.session: aiohttp.ClientSession | None = None
        self.cache_reporters: set[str] = set()
        """Backends that have reported `cached_tokens` (SGLang's `--enable-cache-report` is on)."""
        self.router = Router(settings.seed)
        """The routing core (`policies.routing`): override, fallback, backend choice, failover."""
        self.client_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout_s, connect=None, sock_read=None
        )
        self._model: dict[str, str | None] = {
            "baseline": settings.baseline_model,
            "eagle": settings.eagle_model,
        }
        self.identity = BackendIdentity.from_settings(settings)
        """What clients may learn of the backends: every client-bound message passes it."""
        self._auth: dict[str, str | None] = {
            pool: f"Bearer {key.get_secret_value()}" if key is not None else None
            for pool, key in (("baseline", settings.baseline_api_key), ("eagle", settings.eagle_api_key))
        }

    def auth_header(self, pool: Pool) -> str | None:
        """The Authorization header configured for `pool` (None: forward the client's)."""
        return self._auth[pool]

    def response_headers(self, resp: aiohttp.ClientResponse, decision: Decision) -> CIMultiDict[str]:
        return client_headers(resp.headers, decision, show_backend=self.settings.backend_header)

    def attempt_failed(self, backend: BackendState, why: str) -> None:
        if self.outlier is not None and self.outlier.failure(backend, self.clock(), why):
            self.metrics.ejection(backend.pool, backend.name)

    def attempt_succeeded(self, backend: BackendState) -> None:
        if self.outlier is not None:
            self.outlier.success(backend)

    def release(self, reservation: Reservation) -> None:
        """Release a slot and let a request waiting for one have it."""
        self.tracker.release(reservation)
        if self.admission is not None:
            self.admission.released(reservation.backend.pool)

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
        return upstream_headers(headers)

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

    async def open(
        self, backend: BackendState, path: str, data: bytes, headers: CIMultiDict[str], stream: bool
    ) -> Upstream:
        assert self.session is not None, "the app's cleanup_ctx has not started"
        name = backend.name
        limit = self.settings.response_limit_bytes
        resp: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(self.settings.first_byte_timeout_s):
                resp = await self.session.post(
                    backend.url + path, data=data, headers=headers, timeout=self.client_timeout,
                    allow_redirects=False,
                )  # fmt: skip
                if resp.status < 200 or 300 <= resp.status < 400:
                    # A 101 cannot be relayed over this proxy's HTTP/1.1 exchange, and a redirect would
                    # send the prompt (or, as a GET, lose it) where the backend says: both are
                    # backend errors, retried once elsewhere like a 5xx.
                    where = resp.headers.get("Location", "")
                    raise UpstreamFailure(
                        BackendFailed(
                            f"backend {name} answered HTTP {resp.status}"
                            + (" (a redirect, not followed: check the backend URL)" if where else "")
                        ),
                        unreachable=False,
                        timeout=False,
                    )
                encoded = resp.headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
                if stream and resp.status == 200 and not encoded:
                    head = await read_first_event(resp, limit)
                    return Upstream(resp, head, True, _first_event_is_error(head), self.clock())
                if stream and resp.status == 200:  # compressed despite identity: relayed as it is
                    head = await resp.content.readany()
                    return Upstream(resp, head, True, False, self.clock(), opaque=True)
                body = await read_bounded(resp, limit)
                return Upstream(resp, body, False, resp.status >= 500, self.clock())
        except BaseException as e:
            if resp is not None:
                resp.close()
            if isinstance(e, UpstreamFailure):
                raise
            if isinstance(e, aiohttp.ConnectionTimeoutError):
                # The host never completed the TCP handshake: unreachable, like a refusal.
                raise UpstreamFailure(
                    BackendFailed(f"backend {name} did not accept the connection in time"),
                    unreachable=True,
                    timeout=False,
                ) from None
            if isinstance(e, TimeoutError):
                raise UpstreamFailure(
                    BackendTimeout(f"backend {name} timed out before the first byte"),
                    unreachable=False,
                    timeout=True,
                ) from None
            if isinstance(e, aiohttp.ClientConnectorError):
                raise UpstreamFailure(
                    BackendFailed(f"backend {name} refused the connection: {_os_reason(e.os_error)}"),
                    unreachable=True,
                    timeout=False,
                ) from None
            if isinstance(e, ResponseTooLarge):
                raise UpstreamFailure(
                    BackendFailed(f"backend {name} sent an {e}"), unreachable=False, timeout=False
                ) from None
            if isinstance(e, aiohttp.ClientError | OSError):
                raise UpstreamFailure(
                    BackendFailed(f"backend {name} failed before the first byte: {type(e).__name__}"),
                    unreachable=False,
                    timeout=False,
                ) from None
            raise

    async def read_body(self, request: web.Request) -> bytes:
        """The request body within `body_limit_bytes`, the JSON budget and `body_timeout_s`."""
        s = self.settings
        budget = JsonBudget(s.body_max_json_values, s.body_max_json_containers)
        return await read_body(request, limit=s.body_limit_bytes, budget=budget, timeout_s=s.body_timeout_s)

    async def handle(self, request: web.Request, endpoint: EndpointKind, path: str) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self.active.add(task)
        try:
            return await self._handle(request, endpoint, path)
        finally:
            self.active.discard(task)

    async def _handle(self, request: web.Request, endpoint: EndpointKind, path: str) -> web.StreamResponse:
        arrived = self.clock()
        try:
            raw = await self.read_body(request)
            body = parse_body(raw, endpoint)
            info = request_info(body, endpoint, request.headers, self.settings.allow_client_override)
            blocks = await prompt_blocks(body, endpoint) if self.settings.prefix_tracking else ()
            headers = self._upstream_headers(request.headers)
            if self.settings.log_bodies:
                log.info("request %s %s", path, raw[:65536].decode(errors="replace"))
            if self.admission is not None:
                await self.admission.admit(info.forced_pool, self.clock())
            policy = self.policy
            started = self.clock()
            view = self.tracker.view(started, blocks, info.prompt_tokens)
            chosen = self.decide(policy, info, view, started)
        except SpecrouteError as e:
            self.metrics.reject(e.status)
            raise
        # Same synchronous step as the decision: no await between choose() and reserve().
        run = _Run(self, request, info, body, raw, path, chosen, headers)
        run.reservation = self.tracker.reserve(chosen.backend, info.max_tokens or 0, blocks)
        del body, raw  # `run` holds them until the answer is committed, then lets them go
        try:
            self.metrics.decision(policy.name, chosen.pool, chosen.reason)
            if self.shadows is not None:
                run.shadow = self.shadows.decide(info, view, started, chosen)
            return await run.execute()
        finally:
            self.release(run.reservation)
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
                cached_tokens=run.cached_tokens,
                failed_over=run.decision.backend != chosen.backend,
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
            if run.cached_tokens is not None and run.status == "ok":
                predicted = believed_cached(view, run.decision)
                metrics.prefix_outcome(
                    run.decision.pool, run.decision.backend, predicted, run.cached_tokens, run.prompt_tokens
                )
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


def believed_cached(view: LoadView, decision: Decision) -> int:
    """The prompt tokens the view believed cached on the backend that served."""
    for b in view.pool(decision.pool).backends:
        if b.name == decision.backend:
            return b.cached_tokens
    return 0


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
        headers: CIMultiDict[str],
    ) -> None:
        self.fwd = fwd
        self.headers = headers
        """The client's headers as they go upstream."""
        self.request = request
        self.info = info
        self.body = body
        self.raw = raw
        self.strip_usage = False
        """specroute asked for the usage chunk on the client's behalf: it is not relayed."""
        asked = ask_for_usage(raw, body) if info.endpoint != "generate" else None  # meta_info counts
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
        self.cached_tokens: int | None = None
        """Prompt tokens the backend reported served from its prefix cache (None: not reported)."""
        self.prompt_tokens: int | None = None

    def _read_cache_report(self, data: bytes) -> None:
        """`cached_tokens` and `prompt_tokens` from the answer's usage (or `meta_info`). SGLang
        writes `prompt_tokens_details: null` both when it reports no cache (no
        `--enable-cache-report`) and when nothing was cached: after a backend has reported a
        number once, a null from it means 0."""
        self.prompt_tokens = reported_prompt_tokens(data)
        cached = reported_cached_tokens(data)
        reporters = self.fwd.cache_reporters
        name = self.reservation.backend.name
        if cached is not None:
            reporters.add(name)
        elif self.prompt_tokens is not None and name in reporters:
            cached = 0
        self.cached_tokens = cached

    async def execute(self) -> web.StreamResponse:
        try:
            up = await self._connect()
            # Committed: nothing is sent upstream again, so the body (a long prompt, twice: bytes
            # and parsed) need not live as long as the stream.
            self.raw, self.body = b"", {}
            self.first_byte_at = up.first_byte_at if up.streaming else None
            if not up.streaming:
                return await self._whole(up)
            return await self._relay(up)
        except asyncio.CancelledError:
            # The client went away, or a shutdown cut the request: whatever it did not read
            # must not keep its connection (and buffer) alive.
            self.status = "client_closed"
            _abort(self.request)
            raise

    async def _connect(self) -> Upstream:
        fwd = self.fwd
        headers = self.headers
        tried: set[str] = set()
        failure: UpstreamFailure | None = None
        while True:
            backend = self.reservation.backend
            tried.add(backend.name)
            data, hdrs = fwd._for_pool(backend.pool, self.raw, self.body, headers)
            self.spec = None
            # /generate is left alone: its meta_info has no sglext member to ask for and strip.
            if fwd.settings.spec_details and backend.pool == "eagle" and self.info.endpoint != "generate":
                asked = ask_for_spec_details(data, self.body)
                self.spec = SpecEvents(strip=asked is not None)
                data = asked or data
            up: Upstream | None = None
            if self.sent_at is None:
                self.sent_at = fwd.clock()
            try:
                up = await fwd.open(backend, self.path, data, hdrs, self.info.stream)
            except UpstreamFailure as f:
                fwd.attempt_failed(backend, f.error.message)
                failure = f
            else:
                if not up.retryable:
                    if not up.streaming:
                        fwd.attempt_succeeded(backend)  # a stream's fate is known at its end
                    return up
                fwd.attempt_failed(
                    backend, f"HTTP {up.resp.status}" + (" queue full" if up.streaming else "")
                )
            alt = None
            if len(tried) < 2:
                alt = fwd.failover_target(backend, tried, self.info.forced_pool is not None)
            if alt is None:
                if up is not None:
                    return up  # relay the backend's own error as it sent it
                assert failure is not None
                self.status = "timeout" if failure.timeout else "error"
                error: SpecrouteError = failure.error
                if failure.unreachable and all(b.name in tried for b in fwd.tracker.usable(fwd.clock())):
                    # Every backend is down (this request just found the last one refusing):
                    # that is "no healthy backend", the same answer later requests get at once.
                    error = NoBackendAvailable(f"no healthy backend ({failure.error.message})")
                self.http_status = error.status
                raise error
            if up is not None:
                up.resp.close()
            fwd.metrics.failover(backend.pool)
            self.reservation = fwd.tracker.move(self.reservation, alt.name)
            if fwd.admission is not None:
                fwd.admission.released(backend.pool)
            self.decision = replace(self.decision, pool=alt.pool, backend=alt.name, reason="failover")

    async def _whole(self, up: Upstream) -> web.StreamResponse:
        resp = up.resp
        self.http_status = resp.status
        self.status = "ok" if resp.status < 400 else "error"
        body = up.head
        if resp.status == 200:
            self.tokens = completion_tokens(body, self.info.endpoint)
            self._read_cache_report(body)
            if self.spec is not None:
                stripped, details = drop_sglext_member(body)
                self.accept_length = accept_length(details, self.tokens)
                if self.spec.strip_event:
                    body = stripped
        out = web.Response(
            status=resp.status, body=body, headers=self.fwd.response_headers(resp, self.decision)
        )
        # Written here, not by aiohttp after the handler returns, so a client that does not read
        # is given up after client_write_timeout_s instead of holding its connection forever.
        limit = self.fwd.settings.client_write_timeout_s
        try:
            async with asyncio.timeout(limit):
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
        _abort(self.request)

    async def _relay(self, up: Upstream) -> web.StreamResponse:
        resp = up.resp
        fwd = self.fwd
        settings = fwd.settings
        clean = False
        sr = web.StreamResponse(status=resp.status, headers=fwd.response_headers(resp, self.decision))
        self.http_status = resp.status
        strip_usage = self.strip_usage and not up.opaque
        try:
            await sr.prepare(self.request)
            tail = [b"", b"", b""]
            content = resp.content
            loop = asyncio.get_running_loop()
            chunk = up.head
            # Bytes after the last complete SSE event are held back until the event is whole, so
            # an error event sent after a break never lands inside a torn one. SGLang writes whole
            # events, so this is normally empty; it is bounded in case a backend never sends "\n\n".
            held = _Holdback()
            try:
                with RelayWatchdog(settings.idle_timeout_s, settings.client_write_timeout_s) as dog:
                    while chunk:
                        tail[0], tail[1], tail[2] = tail[1], tail[2], chunk
                        if content.at_eof():
                            break  # the last piece goes out with the terminating chunk, in one write
                        if not up.opaque:
                            chunk = held.push(chunk)
                        if strip_usage:
                            chunk = drop_usage_events(chunk)
                        if self.spec is not None:
                            chunk = self.spec.strip(chunk)
                        if chunk:
                            began = loop.time()
                            dog.writing(began)
                            await sr.write(chunk)
                            now = loop.time()
                            dog.reading(now, now - began)
                        chunk = await content.readany()
            except Stalled as e:
                if e.side == "client":
                    self._client_stalled(e.seconds)
                    return sr
                self.status = "timeout"
                fwd.attempt_failed(self.reservation.backend, f"silent for {e.seconds:g} s")
                await self._break(sr, f"backend {self.decision.backend} sent nothing for {e.seconds:g} s")
                return sr
            except (aiohttp.ClientError, OSError) as e:
                transport = self.request.transport
                if transport is None or transport.is_closing():
                    raise ConnectionResetError from None  # our own client went away (write failed)
                self.status = "error"
                fwd.attempt_failed(self.reservation.backend, f"stream broke: {type(e).__name__}")
                await self._break(sr, f"backend {self.decision.backend} stream broke: {type(e).__name__}")
                return sr
            last_piece = held.rest() + chunk
            if not up.opaque and last_piece and not _ends_an_event(last_piece):
                # The answer ended inside an event: a close-delimited stream whose connection was
                # torn (without chunked framing the end of the body looks like its end).
                end = last_piece.rfind(b"\n\n") + 2
                head = last_piece[:end] if end > 1 else b""
                if head:
                    await self._write_or_give_up(sr, drop_usage_events(head) if strip_usage else head)
                self.status = "error"
                fwd.attempt_failed(self.reservation.backend, "stream ended inside an event")
                await self._break(sr, f"backend {self.decision.backend} stream ended inside an event")
                return sr
            clean = True
            self.status = "ok" if resp.status < 400 and not up.retryable else "error"
            if not up.retryable:  # a relayed queue-full event was counted as a failure already
                fwd.attempt_succeeded(self.reservation.backend)
            if not up.opaque:
                last_events = b"".join(tail)
                self.tokens = completion_tokens(last_events, self.info.endpoint)
                if resp.status == 200:
                    self._read_cache_report(last_events)
            if strip_usage:
                last_piece = drop_usage_events(last_piece)
            if self.spec is not None:
                last_piece = self.spec.strip(last_piece)
                self.accept_length = accept_length(self.spec.details, self.tokens)
            await self._write_or_give_up(sr, last_piece, eof=True)
            return sr
        except ConnectionResetError:
            self.status = "client_closed"
            return sr
        finally:
            if clean:
                resp.release()
            else:
                resp.close()  # the backend sees the disconnect and aborts the generation

    async def _write_or_give_up(self, sr: web.StreamResponse, data: bytes, *, eof: bool = False) -> bool:
        """Write (and end, with `eof`) within client_write_timeout_s; False when the client was given up."""
        limit = self.fwd.settings.client_write_timeout_s
        try:
            async with asyncio.timeout(limit):
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
            event = StreamBroken(self.fwd.identity.for_clients(message)).sse_event()
            if await self._write_or_give_up(sr, event):
                await self._write_or_give_up(sr, b"", eof=True)
        except ConnectionResetError:
            self.status = "client_closed"


class _Holdback:
    """The bytes after the last complete SSE event, held back until their event is whole. Each
    byte is searched once; past `_MAX_HELD_BACK` bytes without an event's end they go out anyway."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0

    def _take(self, more: bytes = b"") -> bytes:
        out = b"".join((*self._parts, more)) if self._parts else more
        self._parts, self._size = [], 0
        return out

    def push(self, chunk: bytes) -> bytes:
        """What of the events so far may go out now."""
        if chunk.endswith(b"\n\n"):
            return self._take(chunk)
        cut = chunk.rfind(b"\n\n") + 2
        if cut == 1 and self._parts and self._parts[-1].endswith(b"\n") and chunk.startswith(b"\n"):
            cut = 1  # the blank line straddles the previous chunk and this one
        elif cut == 1:
            self._parts.append(chunk)
            self._size += len(chunk)
            return self._take() if self._size >= _MAX_HELD_BACK else b""
        out = self._take(chunk[:cut])
        if cut < len(chunk):
            self._parts, self._size = [chunk[cut:]], len(chunk) - cut
        return out

    def rest(self) -> bytes:
        return self._take()
