"""Where requests come from: an open loop (arrival times) or a closed loop of clients.

A source schedules arrival events (firing `fire`, the engine's arrival handler): `start` the
first ones, `arrived` after each arrival (the open loop pushes the next arrival time),
`finished` after each completion (the closed loop's client sends its next request at once).
Each request's phase says whether it is measured.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from simulator.engine.events import EventQueue, Handler

WARMUP, MEASURED, FILLER, NOT_SENT = 0, 1, 2, -1


class OpenLoop:
    """Requests arrive at given, sorted times; every request is measured."""

    __slots__ = ("arrivals", "events", "fire", "n", "phase")

    def __init__(self, arrivals: Sequence[float], events: EventQueue, fire: Handler) -> None:
        self.arrivals = arrivals
        self.events = events
        self.fire = fire
        self.n = len(arrivals)
        self.phase = [MEASURED] * self.n

    def start(self) -> None:
        if self.n:
            self.events.at(self.arrivals[0], self.fire, 0)

    def arrived(self, a: int) -> None:
        if a + 1 < self.n:
            events = self.events
            seq = events.seq
            events.seq = seq + 1
            heapq.heappush(events.heap, (self.arrivals[a + 1], seq, self.fire, a + 1))

    def finished(self, done: Sequence[int], t: float) -> None:
        pass


class ClosedLoop:
    """`concurrency` clients, each sending the next request (in batch order) as soon as its
    previous one finished, by the rule `specroute bench` uses.

    A request that starts while fewer than `warmup` requests have completed is warm-up; the
    next `measure` starts are measured; after that clients send fillers until every measured
    request has finished, so each measured request runs with `concurrency` in flight; then
    they stop. Without `measure` every request is measured and the loop ends with the batch.
    """

    __slots__ = (
        "completed",
        "concurrency",
        "events",
        "fire",
        "measure",
        "measured_done",
        "measured_started",
        "n",
        "phase",
        "sent",
        "warmup",
    )

    def __init__(
        self, n: int, concurrency: int, warmup: int, measure: int | None, events: EventQueue, fire: Handler
    ) -> None:
        self.n = n
        self.fire = fire
        self.concurrency = concurrency
        self.warmup = warmup
        self.measure = measure
        self.events = events
        self.phase = [NOT_SENT] * n
        self.sent = 0
        self.completed = 0
        self.measured_started = 0
        self.measured_done = 0

    def _next_phase(self) -> int:
        if self.sent >= self.n:
            return NOT_SENT
        if self.measure is None:
            return MEASURED
        if self.completed < self.warmup:
            return WARMUP
        if self.measured_started < self.measure:
            self.measured_started += 1
            return MEASURED
        if self.measured_done < self.measure:
            return FILLER
        return NOT_SENT

    def _send(self, t: float) -> bool:
        """The next request, sent at `t` (False: none is sent)."""
        ph = self._next_phase()
        if ph == NOT_SENT:
            return False
        self.phase[self.sent] = ph
        self.events.at(t, self.fire, self.sent)
        self.sent += 1
        return True

    def start(self) -> None:
        for _ in range(self.concurrency):
            if not self._send(0.0):
                break

    def arrived(self, a: int) -> None:
        pass

    def finished(self, done: Sequence[int], t: float) -> None:
        phase = self.phase
        for r in done:
            self.completed += 1
            if phase[r] == MEASURED:
                self.measured_done += 1
            self._send(t)
