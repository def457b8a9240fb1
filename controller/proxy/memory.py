"""One process-wide memory budget for what specroute holds per request.

How it works: every place that holds a request's or an answer's bytes in memory takes them from
this budget first, in the step that allocates them, and gives them back when it lets them go:
request bodies as they are read (after decompression, charged `BODY_COPIES` times: the read
buffer, its bytes and the parsed JSON live at once), a stream's first event and held-back bytes,
and a non-streaming answer. A body of declared length is charged whole before it is read, and
a non-streaming answer past 1 MiB is charged ahead of its bytes, doubling towards
`response_limit_bytes` (`upstream._reserve`), and a stream's first event past 1 MiB at once for
the largest allowed, so work that cannot fit is refused early, not after many megabytes were
read only to be dropped. `take` never waits: when the budget cannot cover the bytes, the caller
refuses the work at once (a client gets 503 with `Retry-After`; a backend's answer that does not
fit is answered 502), so the process stays up instead of running out of memory. Only a large
first event waits (`take_waiting`, first come first served, bounded by `admission_wait_s`): it
stops reading until the budget has its share, then 502 if none came. A
`Charge` belongs to one request and is released once, from a `finally`, whatever happened.

`keep_heap_small` makes the memory of a request that ended go back to the OS at once.

What is not counted: per-connection buffers of aiohttp (bounded by its flow control) and the
interpreter itself; the default (`memory_budget_bytes`, 512 MiB) leaves room for those in a 1 GiB
container.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
from collections import deque
from collections.abc import Callable

BODY_COPIES = 5
"""A request body is held about five times at its peak: the read buffer and its bytes, the parsed
JSON, the copy that asks for the usage chunk, the prompt's canonical text (measured with
`benchmarks/hostile_bodies.py`)."""
ANSWER_COPIES = 4
"""A first event or whole answer: the read buffer and its bytes, the chunked framing's copy and
the client transport's buffer."""


def keep_heap_small() -> None:
    """Make freed large buffers go back to the OS at once (glibc): a fixed mmap threshold, so
    every allocation over 1 MiB is its own mapping, unmapped when freed. glibc's default raises
    the threshold after the first large free, after which 30 MB bodies come from the heap and
    their pages stay resident long after the requests ended. (At 128 KiB an ordinary request
    paid a dozen page faults: `benchmarks/proxy_overhead.py`.) Does nothing elsewhere."""
    global _trim
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1024 * 1024)
        _trim = libc.malloc_trim
        # the heap's own top is trimmed past 32 MiB only: trimming at every request's end would cost
        # a brk() and fresh page faults per request (`benchmarks/proxy_overhead.py`)
        libc.mallopt(_M_TRIM_THRESHOLD, 32 * 1024 * 1024)
    except (OSError, AttributeError):
        pass


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
TRIM_AFTER = 16 * 1024 * 1024
"""Bytes given back to the budget after which the heap's free pages are returned to the OS
(`malloc_trim`) once the budget is empty: what buffers of up to 1 MiB leave scattered in the heap."""
TRIM_DELAY_S = 0.5
"""How long the budget must stay empty before the trim: the buffers are freed after the charges
that counted them, and a trim while requests keep coming would cost a walk of the heap (tens of
ms) for pages about to be used again."""
_trim: Callable[[int], object] | None = None


class MemoryBudget:
    __slots__ = ("_given", "_pending", "_waiters", "limit", "refusals", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.refusals = 0
        """How often work was refused (`specroute_memory_budget_refusals_total` reads it)."""
        self._given = 0
        self._pending: asyncio.TimerHandle | None = None
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def take(self, n: int, *, count: bool = True) -> bool:
        """Take `n` bytes if the budget has them; False (and nothing taken, a refusal counted
        unless not `count`: the caller will wait instead) otherwise."""
        if self.used + n > self.limit:
            self.refusals += count
            return False
        self.used += n
        return True

    async def take_waiting(self, n: int) -> None:
        """Take `n` bytes (at most `limit`), waiting, first come first served, until others have
        given back enough; the caller bounds the wait (cancelled, nothing is taken). Only large
        reservations wait (a first event past 1 MiB, `upstream`; a body declared over 1 MiB,
        `limits`): `take` does not wait behind them, so ordinary requests are not held up by one."""
        if not self._waiters and self.used + n <= self.limit:
            self.used += n
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give(n)  # woken with the bytes taken, then cancelled before it ran
            else:
                with contextlib.suppress(ValueError):  # not handed over: still queued, or popped as done
                    self._waiters.remove(entry)
                self._wake()  # the next waiter may fit now
            raise

    @property
    def waiting(self) -> int:
        """Reservations waiting for the budget now (large first events and bodies, `take_waiting`)."""
        return sum(1 for _, waiter in self._waiters if not waiter.done())

    def _wake(self) -> None:
        """Hand the bytes given back to the waiters at the head of the queue that they cover."""
        waiters = self._waiters
        while waiters:
            n, waiter = waiters[0]
            if not waiter.done():
                if self.used + n > self.limit:
                    return
                self.used += n
                waiter.set_result(None)
            waiters.popleft()

    def give(self, n: int) -> None:
        self.used = max(0, self.used - n)
        self._given += n
        if self._waiters:
            self._wake()
        if self.used or self._given < TRIM_AFTER or _trim is None or self._pending is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._trim()
            return
        self._pending = loop.call_later(TRIM_DELAY_S, self._trim)

    def _trim(self) -> None:
        """Return the heap's free pages to the OS if the budget is (still) empty; else later."""
        self._pending = None
        if self.used == 0 and _trim is not None:
            self._given = 0
            _trim(0)  # once after a burst: a trim per release would cost more than it gives back


class Charge:
    """What one request holds of the budget; `grow` as its buffers grow, `release` once."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.held = 0

    def grow_to(self, n: int, *, count: bool = True) -> bool:
        """Hold `n` bytes in all (more than now: take the difference); False when refused."""
        more = n - self.held
        if more <= 0:
            return True
        if not self.budget.take(more, count=count):
            return False
        self.held = n
        return True

    async def grow_to_waiting(self, n: int) -> None:
        """`grow_to` that waits for the budget (`MemoryBudget.take_waiting`); `n` <= its limit."""
        more = n - self.held
        if more > 0:
            await self.budget.take_waiting(more)
            self.held = n

    def shrink_to(self, n: int) -> None:
        if n < self.held:
            self.budget.give(self.held - n)
            self.held = n

    def release(self) -> None:
        """Give back all it holds (again: nothing)."""
        if self.held:
            self.budget.give(self.held)
            self.held = 0
