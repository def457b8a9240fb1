"""A clock a test drives, for a `serve` subprocess started through `tests/driven_serve.py`.

Every deadline of the proxy (first byte, silence, request and body timeouts, admission waits,
back-offs, ejections, health probes) reads the one clock the app is given. In-process tests pass
`fakes.ShiftedClock`; a `serve` subprocess gets this one from `driven_serve.py`, which runs the
real `serve` (`controller.cli.serve.run_serve`) with it injected and adds `POST /_test/clock`
(`{"advance_s": N}` moves it on N seconds), so the test moves a deadline past instead of sleeping.
`DrivenClock.sleep` is a sleep on this clock (it ends at the advance that moves the clock past
its deadline, or when real time gets there): serve uses it for the settle intervals of a SIGHUP
reload (`reload_settle_s`) and `shutdown_grace_s`. What is not on the clock is not moved: the
drain (`drain_timeout_s`), aiohttp's own header timeout, and the scrape interval.

Nothing of this ships: `specroute serve` has no such route and no switch that adds one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time

from aiohttp import web
from fakes import POLL_S

PATH = "/_test/clock"


class DrivenClock:
    """`time.monotonic()` plus what the test advanced it by."""

    PATH = PATH
    poll_s = POLL_S
    """Its time jumps: the proxy's timers on it look again this often (`controller.proxy.watchdog.poll_s`)."""

    def __init__(self) -> None:
        self.offset = 0.0
        self._moved = asyncio.Event()
        """Set (and replaced by a fresh one) by each advance: wakes the sleepers."""

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    async def sleep(self, seconds: float) -> None:
        """`asyncio.sleep(seconds)` on this clock: returns once the clock has passed `seconds`
        from the call, by real time going by or by an advance, whichever comes first."""
        deadline = self() + seconds
        while (left := deadline - self()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), left)

    async def handle(self, request: web.Request) -> web.Response:
        """`POST /_test/clock {"advance_s": N}`: move on N >= 0 seconds; answers the offset."""
        try:
            advance = float(json.loads(await request.read())["advance_s"])
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": 'expected {"advance_s": N}'}, status=400)
        if not math.isfinite(advance) or advance < 0:
            return web.json_response({"error": "advance_s must be finite and >= 0"}, status=400)
        self.offset += advance
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()
        return web.json_response({"offset_s": self.offset})
