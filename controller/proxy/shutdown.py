"""Graceful shutdown in the order load balancers expect.

On SIGTERM (or SIGINT) `serve` calls `Shutdown.begin()`; from then on `/ready` answers 503 while
every other route keeps serving for `shutdown_grace_s`, so a balancer that polls readiness (or
Kubernetes removing the pod from its endpoints) stops sending new requests before the listener
closes. Answers given during the grace period carry `Connection: close`, so a client's
keep-alive connection is not reused after it and its next request finds the balancer's new
choice. Then `app.drain` closes the listener and lets in-flight work finish for
`drain_timeout_s`. A second signal during the grace period ends the grace period at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import hdrs, web


class Shutdown:
    """Whether (and since when, on the app's clock) a shutdown has begun."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started_at: float | None = None

    @property
    def started(self) -> bool:
        return self.started_at is not None

    def begin(self) -> None:
        if self.started_at is None:
            self.started_at = self._clock()


SHUTDOWN = web.AppKey("shutdown", Shutdown)


async def close_after_answer(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` hook: once shutting down, no answer leaves its connection open."""
    if request.app[SHUTDOWN].started:
        response.force_close()
        response.headers[hdrs.CONNECTION] = "close"
