"""The errors specroute itself answers with, in OpenAI's shape.

Every class knows its HTTP status, its OpenAI `type` and a short `code`; `response()` renders
`{"error": {"message", "type", "param": null, "code"}}`. Lower-level failures (aiohttp client
errors, timeouts) are translated into these where they enter, in `forward.py`. Errors that a
backend returns after it was chosen are NOT wrapped: they are relayed as the backend sent them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("specroute.errors")


class _MalformedHttpFilter(logging.Filter):
    """aiohttp logs a client's malformed HTTP (oversized header, bad request line) with a traceback
    whose message quotes the offending bytes -- possibly an Authorization header -- and a body it
    cannot decode after the answer went out. Such a record is rewritten to one INFO line naming
    the error class only."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError | RequestPayloadError):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "a client"
            record.msg, record.args = "malformed HTTP from %s: %s", (peer, type(exc).__name__)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


http_log = logging.getLogger("specroute.http")
"""The logger of aiohttp's HTTP protocol handler (`make_runner` passes it): no client bytes in it."""
http_log.addFilter(_MalformedHttpFilter())


class SpecrouteError(Exception):
    """Base of every error answered by specroute itself."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, *, headers: dict[str, str] | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        self.param = param
        """The request field at fault (OpenAI's `param`), when there is one."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=json.dumps(self.body()).encode(),
            content_type="application/json",
            headers=self.headers,
        )

    def sse_event(self) -> bytes:
        """The error as an SSE event followed by `[DONE]` (for streams broken after the first byte)."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\ndata: [DONE]\n\n"


class BadRequest(SpecrouteError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(SpecrouteError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(SpecrouteError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(SpecrouteError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class ExpectationFailed(SpecrouteError):
    """An `Expect` header other than `100-continue` (the only expectation HTTP/1.1 defines)."""

    status = 417
    type = "invalid_request_error"
    code = "expectation_failed"


class RequestTimeout(SpecrouteError):
    """The client did not send its whole request body within `body_timeout_s`."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(SpecrouteError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class Overloaded(SpecrouteError):
    """Every backend the request may use is at its in-flight bound, and it waited long enough."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class RetrySoon(SpecrouteError):
    """503 with `Retry-After: 1`: specroute or its backends are busy now, not broken; the
    subclasses say with what (`code`)."""

    status = 503
    type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": "1"})


class BackendFailed(SpecrouteError):
    """The backend failed before the first byte (refused, reset, broken answer)."""

    status = 502
    type = "server_error"
    code = "backend_failed"


class NoBackendAvailable(SpecrouteError):
    status = 503
    type = "server_error"
    code = "no_healthy_backend"


class ShuttingDown(SpecrouteError):
    """`/ready` after SIGTERM: the process still serves, but balancers should look elsewhere."""

    status = 503
    type = "server_error"
    code = "shutting_down"


class BackendTimeout(SpecrouteError):
    status = 504
    type = "server_error"
    code = "backend_timeout"


class StreamBroken(SpecrouteError):
    """A stream died or idled out after its first byte reached the client (sent as an SSE event)."""

    status = 502
    type = "server_error"
    code = "stream_broken"


def http_error_response(e: web.HTTPException) -> web.Response:
    """Any other HTTP error aiohttp raised itself, re-rendered in OpenAI's shape (same status)."""
    body = {
        "error": {
            "message": e.text or e.reason,
            "type": "server_error" if e.status >= 500 else "invalid_request_error",
            "param": None,
            "code": e.reason.lower().replace(" ", "_").replace("-", "_"),
        }
    }
    return web.Response(
        status=e.status,
        body=json.dumps(body).encode(),
        content_type="application/json",
        headers={k: v for k, v in e.headers.items() if k in _KEPT},
    )


_KEPT = frozenset({"Allow", "Retry-After", "WWW-Authenticate"})


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """Every route's `Expect` handler: `100-continue` as aiohttp does; anything else a 417 in
    OpenAI's shape (aiohttp's own answers it in plain text, before any middleware runs)."""
    expect = request.headers.get("Expect", "")
    if request.version >= (1, 1) and expect.lower() != "100-continue":
        return ExpectationFailed(f"unsupported Expect header {expect[:60]!r} (only 100-continue)").response()
    if request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's default handler: the body starts after it
    return None


CLIENT_TEXT: web.AppKey[Callable[[str], str]] = web.AppKey("client_text")
"""What the app's errors' messages pass on their way to a client (`identity.BackendIdentity.
for_clients`, set when backend names are hidden: `backend_header: false`); absent: as they are."""


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render our errors, and every error aiohttp raises itself (404, 405, 413, 400 ...), in
    OpenAI's shape; other HTTP exceptions (redirects) pass. The message of every specroute
    error passes the app's `CLIENT_TEXT` (a backend's own answers are relayed as they are)."""
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except SpecrouteError as e:
        for_clients = request.app.get(CLIENT_TEXT)
        if for_clients is not None:
            e.message = for_clients(e.message)
        return e.response()
    except web.HTTPNotFound:
        return NotFound(f"unknown route {request.method} {request.path}").response()
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        return MethodNotAllowed(
            f"method {request.method} not allowed on {request.path} (allowed: {allowed})",
            headers={"Allow": ",".join(sorted(e.allowed_methods))},
        ).response()
    except web.HTTPRequestEntityTooLarge as e:
        return PayloadTooLarge(f"request body too large: {e.text}").response()
    except RequestPayloadError as e:  # e.g. a Content-Encoding the body does not match
        return BadRequest(f"request body could not be read: {e.__cause__ or e}").response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return http_error_response(e)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return SpecrouteError("internal error in specroute").response()
