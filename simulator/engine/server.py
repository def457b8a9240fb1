"""One simulated server during a run: admission, prefill, decoding, completion.

How it works. Continuous batching is modelled as processor sharing with a load-dependent rate:
while `b` requests are running (admitted: in prefill or decoding, as in the profile's
definition of concurrency), every decoding request advances at `rate(b)` tokens per second.
Instead of touching every request at every event, a server keeps a virtual clock `V` that
advances at `rate(b)`; a request that starts decoding at `V0` with `w` tokens of work finishes
when `V` reaches `V0 + w`. Finishing virtual times sit in a per-server heap, so the next
completion's wall time is `T + (heap top - V) / rate` and an event costs O(log n). EAGLE
requests carry their own acceptance factor `a` (mean 1): their virtual work is `tokens / a` (on
an adaptive server, `a` where it drafts at the batch size the request starts decoding in, else 1:
the work is fixed then, a simplification of a depth that follows the batch).

- `arrive`: a request dispatched here is admitted at once while fewer than
  `max_running_requests` run, else it waits in a FIFO queue.
- `admit`: its prefill (`Prompts.prefill_end`: one request at a time, FIFO, at the profile's
  `prefill_tok_s`, only the prompt tokens the server's prefix cache does not hold) ends, and its
  first token comes `ttft(b)` later (a `FirstToken` event).
- `first_token`: its remaining `n - 1` tokens are decoding work in the heap.
- `complete`: the requests whose work is done leave; queued ones are admitted.

Rescheduling. The live completion is the `Completion` whose `seq` is the server's `done_seq`;
others are skipped. A completion that moves later (the common case: an arrival slows the batch)
is not pushed at once: the server's earlier entry still in the queue (its carrier) pushes it
when it pops, under the `(time, seq)` key it was given, so events pop in exactly the order of
pushing every reschedule.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence

from simulator.engine.cache import BlockCache, cached_prompt_tokens
from simulator.engine.deployment import ServerModel
from simulator.engine.events import EventQueue


class Prompts:
    """The run's prompts: each request's prefix-cache hit and when its prefill ends."""

    __slots__ = ("block_tokens", "blocks", "cached", "prompt_tokens")

    def __init__(
        self,
        prompt_tokens: Sequence[int],
        blocks: Sequence[Sequence[int]] | None,
        block_tokens: int,
        cached: list[int],
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.blocks = blocks
        """Per-request prompt block ids; None when no server caches them."""
        self.block_tokens = block_tokens
        self.cached = cached
        """Per request: the prompt tokens its server's cache held (written at admission)."""

    def prefill_end(self, s: Server, r: int, t: float) -> float:
        """Request `r` is admitted to `s` at `t`: when its prefill ends (the first token follows
        `ttft(b)` later). It references its blocks in the cache until `release`."""
        todo = self.prompt_tokens[r]
        cache, blocks = s.cache, self.blocks
        if cache is not None and blocks is not None:
            hit = cached_prompt_tokens(cache.acquire(blocks[r]), self.block_tokens, todo)
            self.cached[r] = hit
            todo -= hit
        if s.prefill is None or todo <= 0:
            return t
        start = t if t > s.prefill_free else s.prefill_free
        s.prefill_free = start + todo / s.prefill
        return s.prefill_free

    def release(self, s: Server, done: Sequence[int]) -> None:
        cache, blocks = s.cache, self.blocks
        if cache is not None and blocks is not None:
            for r in done:
                cache.release(blocks[r])


class Server:
    """A server's state: running and queued requests, its virtual clock and decode heap."""

    __slots__ = (
        "accept",
        "accept_length",
        "budget",
        "cache",
        "cap",
        "carrier_seq",
        "carrier_t",
        "completion_at",
        "dheap",
        "dirty",
        "done_seq",
        "done_t",
        "drafting",
        "events",
        "finish",
        "finished",
        "first",
        "first_token_at",
        "index",
        "model",
        "name",
        "output_tokens",
        "pool",
        "pool_index",
        "prefill",
        "prefill_free",
        "prompt_tokens",
        "prompts",
        "queue",
        "rate",
        "rate_table",
        "running",
        "slot",
        "speculative",
        "t_last",
        "table_size",
        "tokens",
        "ttft_table",
        "v",
    )

    def __init__(
        self,
        model: ServerModel,
        index: int,
        events: EventQueue,
        prompts: Prompts,
        table_size: int,
        output_tokens: Sequence[int],
        accept: Sequence[float],
        budget: Sequence[int],
        first: list[float],
        finish: list[float],
    ) -> None:
        self.model = model
        self.index = index
        self.name = model.name
        self.pool = model.pool
        self.pool_index = 0 if model.pool == "baseline" else 1
        self.slot = 0
        """Index of this server among its pool's backends (deployment order)."""
        self.accept_length = model.accept_length if model.speculative else None
        self.dirty = True
        """State changed since its `BackendLoad` was last built."""
        self.cap = model.max_running_requests if model.max_running_requests is not None else 1 << 62
        self.prefill = model.prefill_tok_s
        self.prefill_free = 0.0
        """When the prefill of the requests admitted so far ends."""
        cache_blocks = (model.cache_tokens or 0) // prompts.block_tokens
        self.cache = BlockCache(cache_blocks) if cache_blocks > 0 and prompts.blocks is not None else None
        """The server's prefix cache; None when it has none or the run's prompts have no blocks
        (nothing could hit it: admission takes the inlined path)."""
        self.rate_table = model.rate
        self.speculative = model.speculative
        self.drafting = model.drafting
        self.ttft_table = model.ttft
        self.table_size = table_size
        self.events = events
        self.prompts = prompts
        self.prompt_tokens = prompts.prompt_tokens
        self.output_tokens = output_tokens
        self.accept = accept
        self.budget = budget
        self.first = first
        self.finish = finish
        self.finished: Callable[[Sequence[int], Server, float], None] = _nobody
        """Told of the requests that finished here (set by the engine)."""
        self.first_token_at = self.first_token
        self.completion_at = self.completion
        """The handlers of this server's events (bound once)."""
        self.running = 0
        self.tokens = 0
        """Output-token budget of the requests dispatched here and not finished."""
        self.queue: deque[int] = deque()
        self.dheap: list[tuple[float, int]] = []
        self.v = 0.0
        self.t_last = 0.0
        self.rate = model.rate[0]
        self.done_t = 0.0
        self.done_seq = -1
        """Key of the live completion event (-1: none); it may not be in the queue yet."""
        self.carrier_t = 0.0
        self.carrier_seq = -1
        """Key of this server's earliest entry in the queue (-1: none); it pops no later than
        the live event and pushes it when it is not in the queue yet."""

    def _reschedule(self, done_t: float) -> None:
        """The live completion is now at `done_t`: push it unless the carrier will."""
        events = self.events
        seq = events.seq
        events.seq = seq + 1
        self.done_t = done_t
        self.done_seq = seq
        if self.carrier_seq < 0 or done_t < self.carrier_t:
            heapq.heappush(events.heap, (done_t, seq, self.completion_at, seq))
            self.carrier_t, self.carrier_seq = done_t, seq

    def admit(self, r: int, t: float) -> None:
        """Request `r` starts running at `t`: its prefill, then its first token `ttft(b)` later."""
        running = self.running = self.running + 1
        if self.cache is not None:
            end = self.prompts.prefill_end(self, r, t)
        else:  # `Prompts.prefill_end` without a cache, inlined (the hot path)
            todo = self.prompt_tokens[r]
            prefill = self.prefill
            if prefill is None or todo <= 0:
                end = t
            else:
                start = t if t > self.prefill_free else self.prefill_free
                end = self.prefill_free = start + todo / prefill
        ft = end + (self.ttft_table[running] if running < self.table_size else self.ttft_table[-1])
        events = self.events
        seq = events.seq
        events.seq = seq + 1
        heapq.heappush(events.heap, (ft, seq, self.first_token_at, r))

    def arrive(self, r: int, t: float) -> None:
        """Request `r` is dispatched here at `t`: admitted at once when there is room, else queued."""
        self.tokens += self.budget[r]
        self.dirty = True
        if self.running >= self.cap:
            self.queue.append(r)
            return
        # Advance the virtual clock at the old rate before the batch grows.
        self.v += (t - self.t_last) * self.rate
        self.t_last = t
        self.admit(r, t)
        running = self.running
        rate = self.rate = (
            self.rate_table[running] if running < self.table_size else self.model.rate_at(running)
        )
        if self.dheap:
            # Float rounding may put V a hair past the top: never schedule in the past.
            ahead = self.dheap[0][0] - self.v
            self._reschedule(t + ahead / rate if ahead > 0.0 else t)

    def first_token(self, r: int, t: float) -> None:
        """Request `r` got its first token at `t`: the rest of its output is decoding work."""
        self.first[r] = t
        out = self.output_tokens[r] - 1
        if out <= 0:
            work = 0.0  # nothing to decode: finishes with its first token (a zero-work entry)
        elif not self.speculative:
            work = float(out)
        else:
            drafting = self.drafting
            b = self.running
            if drafting is None or drafting[b if b < len(drafting) else -1]:
                work = out / self.accept[r]
            else:
                work = float(out)
        dheap = self.dheap
        v = self.v + (t - self.t_last) * self.rate
        self.v = v
        self.t_last = t
        heapq.heappush(dheap, (v + work, r))
        if dheap[0][1] == r:  # it went to the top (by value: compiled code boxes a new tuple)
            self._reschedule(t + work / self.rate)

    def completion(self, seq: int, t: float) -> None:
        """The completion event `seq` fired at `t`: when it is the live one, the requests whose
        work is done finish, queued ones are admitted, and the engine is told; a carrier pushes
        the live one."""
        if seq != self.done_seq:
            if seq == self.carrier_seq:
                if self.done_seq >= 0:  # the live event, deferred: it pops no earlier than now
                    live = self.done_seq
                    heapq.heappush(self.events.heap, (self.done_t, live, self.completion_at, live))
                    self.carrier_t, self.carrier_seq = self.done_t, live
                else:
                    self.carrier_seq = -1
            return
        self.done_seq = self.carrier_seq = -1
        dheap = self.dheap
        pop = heapq.heappop
        fv, r = pop(dheap)
        self.v = fv
        self.t_last = t
        done: list[int] | tuple[int]
        if dheap and dheap[0][0] <= fv:
            done = [r]
            while dheap and dheap[0][0] <= fv:
                done.append(pop(dheap)[1])
        else:
            done = (r,)
        budget, finish = self.budget, self.finish
        for r in done:
            finish[r] = t
            self.running -= 1
            self.tokens -= budget[r]
        if self.cache is not None:
            self.prompts.release(self, done)
        self.dirty = True
        queue = self.queue
        while queue and self.running < self.cap:
            self.admit(queue.popleft(), t)
        running = self.running
        rate = self.rate = (
            self.rate_table[running] if running < self.table_size else self.model.rate_at(running)
        )
        if dheap:  # no carrier: the live event just popped
            self._reschedule(t + (dheap[0][0] - fv) / rate)
        self.finished(done, self, t)


def _nobody(done: Sequence[int], s: Server, t: float) -> None:
    pass
