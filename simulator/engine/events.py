"""The engine's event queue: events in `(time, seq)` order, as SimPy orders its events.

An event is `(time, seq, fire, subject)`: at `time`, call `fire(subject, time)`. The handler says
what the event means, so no code has to decode a kind field and positional slots whose meaning
depends on it:

- an arrival: `(t, seq, Engine.arrive, request)`;
- a first token: `(t, seq, server.first_token, request)` (the request's prefill and TTFT are over);
- a completion: `(t, seq, server.completion, seq)` (live when `seq` is the server's `done_seq`,
  else a carrier: see `simulator.engine.server`);
- a scrape: `(t, seq, Scraper.scrape, router)`.

`seq` is handed out by the queue, unique and increasing, so events at the same time fire in the
order they were scheduled and a comparison never looks past it. A sequence number may be taken
before its event is pushed (a server's deferred completion). Plain tuples, typed by `Event` (mypy
checks every push against it), not NamedTuples: a NamedTuple's `__new__` is Python code, run for
every event pushed, and a simulated request has several events.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

Handler = Callable[[int, float], None]
"""What an event does: called with the event's subject (a request, server or router index, or
the completion's own `seq`) and its time."""
Event = tuple[float, int, Handler, int]


class EventQueue:
    """A heap of events ordered by `(time, seq)`; `seq` counts every number handed out."""

    __slots__ = ("heap", "seq")

    def __init__(self) -> None:
        self.heap: list[Event] = []
        self.seq = 0
        """The next sequence number."""

    def __len__(self) -> int:
        return len(self.heap)

    def take(self) -> int:
        """A fresh sequence number (for an event pushed now or later)."""
        seq = self.seq
        self.seq = seq + 1
        return seq

    def at(self, t: float, fire: Handler, subject: int) -> None:
        """Schedule `fire(subject, t)` with a fresh sequence number."""
        seq = self.seq
        self.seq = seq + 1
        heapq.heappush(self.heap, (t, seq, fire, subject))

    def run(self) -> None:
        """Fire events until none is left."""
        heap, pop = self.heap, heapq.heappop
        while heap:
            t, _, fire, subject = pop(heap)
            fire(subject, t)
