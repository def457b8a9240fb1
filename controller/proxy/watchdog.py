"""One timer per relayed stream for two limits: the backend's silence and a blocked client write.

How it works: the relay says which side it waits on and since when -- `reading` (the backend:
nothing arrived since `since`) or `writing` (the client: a write blocked since `since`) -- two
attribute stores per chunk, no timer work. A single `call_at` timer ticks at most every
`min(idle_s, write_s)` seconds; when it fires it compares the current phase's deadline with the
clock: reached, it cancels the relaying task (as `asyncio.timeout` does) and `__exit__` turns
that into `Stalled(side)`; not reached, it re-arms for that deadline or the next tick, whichever
comes first. So a limit is enforced to the tick, time blocked on the client never counts as
backend silence (and the other way round), and a stream costs one timer callback per tick
instead of one timer per chunk.

While a write to the client is blocked the relay does not read from the backend, its TCP window
closes, and the backend's kernel probes it with exponential back-off: once the relay reads again,
the next bytes can take about as long again to come. So the read that follows a write blocked
for `b` seconds may wait `idle_s + b`: silence the client caused is not the backend's.

Both limits, and `ClockTimeout` (`asyncio.timeout` for the request path), read the proxy's one
injected clock, not the loop's. A timer on the loop's clock fires at the deadline; a clock whose
time may jump (a test's, moved past a deadline instead of waited for) says so with a `poll_s`
attribute, and timers on it look again that often (`poll_s`).

A watchdog given a `live` set is in it while it runs: whoever reads the set on the event loop
(`specroute_client_writes_blocked`, at scrape time) sees `side == "client"` only for a relay
suspended in a write the client has not taken, as `writing` is followed by `reading` in the same
step when the write does not block.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from types import TracebackType
from typing import Literal

Side = Literal["backend", "client"]
Clock = Callable[[], float]


def poll_s(clock: Clock) -> float:
    """The longest a timer on `clock` may wait before reading it again: its `poll_s` when it has
    one (its time may jump), else no limit (the loop's timers fire at the deadline)."""
    poll = getattr(clock, "poll_s", math.inf)
    return poll if isinstance(poll, float | int) and poll > 0 else math.inf


class ClockTimeout:
    """`asyncio.timeout(seconds)` on `clock`: the block is cancelled once `clock()` has passed
    `seconds` from entry, and `TimeoutError` raised out of it; None means no limit. A plain
    `with` inside a task (entering and leaving need no await: no coroutine per use, and every
    request enters a few)."""

    __slots__ = ("_clock", "_deadline", "_expired", "_handle", "_loop", "_task", "seconds")

    def __init__(self, seconds: float | None, clock: Clock = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._deadline = 0.0
        self._expired = False
        self._task: asyncio.Task[object] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> ClockTimeout:
        seconds = self.seconds
        if seconds is not None:
            loop = self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task(loop)  # (with the loop given: one getpid() less)
            self._deadline = self._clock() + seconds
            self._arm()
        return self

    def _arm(self) -> None:
        assert self._loop is not None
        remaining = max(0.0, self._deadline - self._clock())
        self._handle = self._loop.call_later(min(remaining, poll_s(self._clock)), self._fire)

    def _fire(self) -> None:
        if self._clock() >= self._deadline:
            self._expired = True
            assert self._task is not None
            self._task.cancel()
        else:
            self._arm()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self._expired and kind is asyncio.CancelledError and self._task is not None:
            if self._task.uncancel() == 0:  # our cancellation, not the client's or a shutdown's
                raise TimeoutError from exc


class Stalled(Exception):
    """The backend sent nothing for `idle_s`, or a write to the client blocked for `write_s`."""

    def __init__(self, side: Side, seconds: float) -> None:
        super().__init__(f"{side} stalled for {seconds:g} s")
        self.side = side
        self.seconds = seconds


class RelayWatchdog:
    def __init__(
        self,
        idle_s: float,
        write_s: float,
        clock: Clock = time.monotonic,
        live: set[RelayWatchdog] | None = None,
    ) -> None:
        self.idle_s = idle_s
        self.write_s = write_s
        self.clock = clock
        """What `reading`'s and `writing`'s `now` are read from, and the deadlines compared to."""
        self.tick_s = min(idle_s, write_s, poll_s(clock))
        self.side: Side = "backend"
        self.since = 0.0
        self.credit = 0.0
        self.blocked_s = 0.0
        """Seconds the relay has spent in writes to the client (the credits given so far)."""
        self.expired: Side | None = None
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[object] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._live = live

    def reading(self, now: float, credit: float = 0.0) -> None:
        """From `now` on the relay waits for the backend, which gets `credit` seconds more than
        `idle_s` (how long the write before this read was blocked)."""
        self.side, self.since, self.credit = "backend", now, credit
        self.blocked_s += credit

    def writing(self, now: float) -> None:
        """From `now` on the relay waits for the client to take a write."""
        self.side, self.since = "client", now

    def __enter__(self) -> RelayWatchdog:
        self._task = asyncio.current_task(self._loop)
        self.reading(self.clock())
        self._handle = self._loop.call_later(self.tick_s, self._fire)
        if self._live is not None:
            self._live.add(self)
        return self

    def _limit(self) -> float:
        return self.idle_s + self.credit if self.side == "backend" else self.write_s

    def _fire(self) -> None:
        now = self.clock()
        due = self.since + self._limit()
        if now >= due:
            self.expired = self.side
            assert self._task is not None
            self._task.cancel()
            return
        self._handle = self._loop.call_later(min(due - now, self.tick_s), self._fire)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self._live is not None:
            self._live.discard(self)
        side = self.expired
        if side is not None and kind is asyncio.CancelledError and self._task is not None:
            if self._task.uncancel() == 0:  # our cancellation, not the client's or a shutdown's
                raise Stalled(side, self.idle_s if side == "backend" else self.write_s) from None
