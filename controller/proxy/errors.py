"""The errors specroute itself answers with, in OpenAI's shape.

Every class knows its HTTP status, its OpenAI `type` and a short `code`; `body()` is
`{"error": {"message", "type", "param": null, "code"}}` (`controller.proxy.http_errors` renders
it as an HTTP answer, `sse_event()` as the event that ends a broken stream). Lower-level failures
(aiohttp client errors, timeouts) are translated into these where they enter (`upstream.py`).
Errors that a backend returns after it was chosen are NOT wrapped: they are relayed as the
backend sent them. No transport here: the request path's transport-free halves raise these.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar


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

    @property
    def http_status(self) -> int:
        """The status the client is answered with (`status`, unless the error relays a backend's)."""
        return self.status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

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
