"""A clock a test drives, for `serve` started with `SPECROUTE_TEST_CLOCK=1` (tests only).

Every deadline of the proxy (first byte, silence, request and body timeouts, admission waits,
back-offs, ejections, health probes) reads the one clock `create_app` is given. In-process tests
pass a shifted clock; a `serve` subprocess has no such seam, so a test of the real process would
have to wait its timeouts out. With the variable set, `serve` runs on `time.monotonic()` plus an
offset and answers `POST /_test/clock` with a JSON body `{"advance_s": N}` by moving the offset
on N seconds, so the test moves a deadline past instead of sleeping. `DrivenClock.sleep` is a
sleep on this clock (it ends at the advance that moves the clock past its deadline, or when real
time gets there): `serve` gives it to the config reloader and to the shutdown's grace period,
so the settle intervals of a SIGHUP reload (`reload_settle_s`) and `shutdown_grace_s` move too
(the listener still takes this route during the grace). What is not on the clock is not moved:
the drain (`drain_timeout_s`: the listener is closed by then and every connection closes after
its answer, so no request could reach this route to move it), aiohttp's own header timeout, and
the scrape interval.

Never set it outside tests: whoever reaches the port could then expire every timeout and every
ejection at will. `serve` refuses it unless it listens on a loopback address, and warns at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import math
import time
from collections.abc import Mapping

from aiohttp import web

ENV = "SPECROUTE_TEST_CLOCK"
PATH = "/_test/clock"


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for the driven clock."""
    return environ.get(ENV, "") not in ("", "0")


def loopback(host: str) -> bool:
    """Whether `host` (a listening address) reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class DrivenClock:
    """`time.monotonic()` plus what the test advanced it by."""

    PATH = PATH

    def __init__(self) -> None:
        self.offset = 0.0
        self._moved = asyncio.Event()
        """Set (and replaced by a fresh one) by each advance: wakes the sleepers."""

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    async def sleep(self, seconds: float) -> None:
        """`asyncio.sleep(seconds)` on this clock: returns once the clock has passed `seconds`
        from the call, by real time going by or by an advance, whichever comes first. It waits
        on the loop's timer for the real time left and on an event each advance sets (and
        replaces), then reads the clock again."""
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
