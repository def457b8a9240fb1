"""specroute's errors as HTTP answers: the app's error middleware, its `Expect` handler, and the
logger of aiohttp's protocol handler (no client bytes in it).

`error_response` renders a `controller.proxy.errors.SpecrouteError` in OpenAI's shape with its
status and headers; every error aiohttp raises itself (404, 405, 413, 400 ...) is re-rendered the
same way by `error_middleware`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError

from controller.proxy.errors import (
    BadRequest,
    ExpectationFailed,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    SpecrouteError,
)

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


def error_response(e: SpecrouteError) -> web.Response:
    """`e` as the client gets it: its status, its headers, OpenAI's error body."""
    return web.Response(
        status=e.http_status,
        body=json.dumps(e.body()).encode(),
        content_type="application/json",
        headers=e.headers,
    )


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
        refused = ExpectationFailed(f"unsupported Expect header {expect[:60]!r} (only 100-continue)")
        return error_response(refused)
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
        return error_response(e)
    except web.HTTPNotFound:
        return error_response(NotFound(f"unknown route {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        return error_response(
            MethodNotAllowed(
                f"method {request.method} not allowed on {request.path} (allowed: {allowed})",
                headers={"Allow": ",".join(sorted(e.allowed_methods))},
            )
        )
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(PayloadTooLarge(f"request body too large: {e.text}"))
    except RequestPayloadError as e:  # e.g. a Content-Encoding the body does not match
        return error_response(BadRequest(f"request body could not be read: {e.__cause__ or e}"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return http_error_response(e)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(SpecrouteError("internal error in specroute"))
