"""The emulated SGLang scheduler: continuous batching driven by a speed profile.

How it works: one asyncio task per server advances every decoding request by one step per
iteration. A step lasts `step_time(b) * time_scale` wall seconds, `b` being the number of
running requests (decoding or waiting for their first token) at the start of the step. A
plain server emits one token per request per step. An EAGLE server runs verify steps of
`accept_length / decode_tok_s(b)` seconds and emits a random accepted length per request
(a chain-acceptance draw whose mean is `accept_length` times the request's hint factor), so
the per-request token rate is the profile's `decode_tok_s(b)` on average. Steps are
scheduled against absolute deadlines, so late timer wake-ups on a loaded machine do not
accumulate drift. An adaptive EAGLE server (`--speculative-adaptive`, `adaptive.py`) picks each
step's draft depth from `b` (SGLang's from its decode batch: here a request waiting for its first
token counts, as it does in the step time and in the profile's concurrency): its step lasts the
depth's verify step (the plain step at depth 0, still counted as a verify step of one token, as
SGLang's per-request `completion_tokens / spec_verify_ct` counts it) and each request accepts up
to that many drafts.
A request's first token arrives `(ttft_s(b) + prefill) * time_scale` after it
is admitted, prefill being its prompt tokens not found in the prefix cache (`cache.py`, matched
at admission as SGLang's scheduler matches when it schedules a prefill) at the profile's
`prefill_tok_s` (none without one); requests beyond `max_running_requests` wait in a FIFO
queue. Each request gets its events (token counts, then a finish) through an asyncio queue
(shared by the samples of one HTTP request, each event tagged with its sample's index); `abort`
removes it and frees its slot at once. After a late wake-up the loop runs the overdue steps
back to back, so a reader may find several events queued at once: it must take them all (as
SGLang's tokenizer manager drains a request's output list), never assume one per step.
"""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from policies.adaptive import alpha_for
from policies.profile import SpeedModel
from simulator.emulator.adaptive import AdaptiveDrafting
from simulator.emulator.cache import CacheHandle, PrefixCache

FinishReason = Literal["stop", "length", "abort"]
_MAX_LAG_S = 0.25
"""A step loop further behind its deadline than this restarts from now instead of catching up."""


@dataclass(frozen=True, slots=True)
class Tokens:
    """`n` new output tokens (one chunk: one decode or verify step) of sample `index`."""

    n: int
    index: int = 0


@dataclass(frozen=True, slots=True)
class Finished:
    reason: FinishReason
    index: int = 0


Event = Tokens | Finished


class QueueFull(Exception):
    """The waiting queue is at `max_queued_requests`."""


@dataclass(eq=False)
class EngineRequest:
    rid: str
    prompt_tokens: int
    output_tokens: int
    """Tokens to generate before finishing (>= 1)."""
    finish_reason: FinishReason = "length"
    """Reason reported when `output_tokens` have been generated ("stop" = EOS reached)."""
    accept_mean: float = 1.0
    """Mean tokens per verify step for this request (1 without speculation)."""
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    """Where its events go; the samples of one HTTP request (n > 1, a batch) share one queue."""
    index: int = 0
    """This request's place among the samples sharing `events` (tags every event it gets)."""
    generated: int = 0
    verify_ct: int = 0
    """Verify steps this request took part in (EAGLE)."""
    accepted_tokens: int = 0
    """Tokens those verify steps produced (accepted drafts plus the bonus token)."""
    proposed_drafts: int = 0
    """Draft tokens those verify steps proposed (the depth of each)."""
    submitted_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: bool = False
    blocks: tuple[int, ...] = ()
    """The prompt's block chain for the prefix cache (empty: nothing to share)."""
    sequence_blocks: Callable[[int], Sequence[int]] | None = None
    """The block chain of the prompt followed by the first `generated` output tokens (what the
    cache keeps once the request ends); None: only the prompt's blocks are kept."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at admission (no prefill for them)."""
    _timer: asyncio.TimerHandle | None = None
    _cache: CacheHandle | None = None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """What SGLang's scheduler reports; refreshed every few decode steps, so it lags."""

    timestamp: float = 0.0
    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    gen_throughput: float = 0.0
    spec_accept_length: float = 0.0
    spec_accept_rate: float = 0.0
    spec_num_steps: int = 0
    """Draft depth of the latest decode step (0: none; adaptive servers change it)."""

    @property
    def spec_num_draft_tokens(self) -> int:
        """Tokens a verify step checks: the drafts and the bonus token (0 without drafting)."""
        return self.spec_num_steps + 1 if self.spec_num_steps else 0

    cache_hit_rate: float = 0.0
    """Cached / prompt tokens of the last prefill batch (admission), as SGLang logs it."""
    num_used_tokens: int = 0
    """KV tokens held by running requests."""
    token_usage: float = 0.0
    """`num_used_tokens / max_total_num_tokens`, rounded to 2 digits as SGLang does."""


class EngineObserver(Protocol):
    """Receives per-request timings (wall seconds) and scheduler stats (for metrics)."""

    def on_admit(self, req: EngineRequest, queue_s: float) -> None: ...
    def on_first_token(self, req: EngineRequest, ttft_s: float) -> None: ...
    def on_chunk(self, req: EngineRequest, n: int, interval_s: float) -> None: ...
    def on_finish(self, req: EngineRequest, reason: FinishReason, e2e_s: float) -> None: ...
    def on_stats(self, stats: SchedulerStats) -> None: ...


class AcceptanceSampler:
    """Accepted length per verify step under chain acceptance with `steps` draft tokens.

    Each draft token is accepted with probability `p` until the first rejection, plus the
    bonus token: k = 1 + j, P(j) = p^j (1-p) for j < steps, P(steps) = p^steps. `p` is solved
    so that E[k] equals the requested mean (clamped to [1, steps + 1]).
    """

    def __init__(self, steps: int, rng: random.Random) -> None:
        self.steps = steps
        self._rng = rng
        self._p_cache: dict[float, float] = {}

    def _p_for(self, mean: float) -> float:
        p = self._p_cache.get(mean)
        if p is None:
            p = self._p_cache[mean] = alpha_for(mean, self.steps)
        return p

    def sample(self, mean: float) -> int:
        if mean <= 1.0 or self.steps <= 0:
            return 1
        if mean >= self.steps + 1:
            return self.steps + 1
        p = self._p_for(mean)
        k = 1
        while k <= self.steps and self._rng.random() < p:
            k += 1
        return k


class BatchEngine:
    """Continuous-batching scheduler of one emulated server. Create and run inside a loop."""

    def __init__(
        self,
        speed: SpeedModel,
        *,
        max_running_requests: int,
        time_scale: float = 1.0,
        accept_length: float | None = None,
        speculative_num_steps: int = 3,
        max_queued_requests: int | None = None,
        stats_interval_steps: int = 40,
        max_total_num_tokens: int = 1_000_000,
        seed: int = 0,
        observer: EngineObserver | None = None,
        cache: PrefixCache | None = None,
        adaptive: AdaptiveDrafting | None = None,
    ) -> None:
        """`cache`: the prefix cache (None: no prefix caching; every prompt token is prefilled).
        `adaptive`: an EAGLE server's depth per step (None: always `speculative_num_steps`)."""
        self.speed = speed
        self.max_running_requests = max_running_requests
        self.time_scale = time_scale
        self.accept_length = accept_length  # None: plain server
        self.speculative_num_steps = speculative_num_steps
        self.max_queued_requests = max_queued_requests
        self.stats_interval_steps = max(1, stats_interval_steps)
        self.observer = observer
        self.max_total_num_tokens = max_total_num_tokens
        self.cache = cache
        self.sampler = AcceptanceSampler(speculative_num_steps, random.Random(seed))
        self.adaptive = adaptive
        self._loop = asyncio.get_running_loop()
        self._queue: collections.deque[EngineRequest] = collections.deque()
        self._running: dict[str, EngineRequest] = {}
        self._decoding: dict[str, EngineRequest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.stats = SchedulerStats(timestamp=self._loop.time())
        # Counters: lifetime and since the last stats refresh.
        self.steps = 0
        self.total_generated = 0
        self.total_verify = 0
        self.total_accepted = 0
        self._win_tokens = 0
        self._win_verify = 0
        self._win_accepted = 0
        self._win_proposed = 0
        self._win_start = self._loop.time()
        self._steps_since_stats = 0

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="emulator-scheduler")

    async def stop(self) -> None:
        self.abort_all()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # -- queries -----------------------------------------------------------------------

    @property
    def speculative(self) -> bool:
        return self.accept_length is not None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def is_active(self, rid: str) -> bool:
        return rid in self._running or any(r.rid == rid for r in self._queue)

    def used_tokens(self) -> int:
        """KV tokens held by running requests (prompt + generated so far)."""
        return sum(r.prompt_tokens + r.generated for r in self._running.values())

    def avg_accept_length(self) -> float | None:
        """Lifetime mean tokens per verify step (bonus included); None before any verify."""
        if not self.speculative or self.total_verify == 0:
            return None
        return self.total_accepted / self.total_verify

    def step_seconds(self, batch: int, steps: int | None = None) -> float:
        """Wall seconds of one decode (or verify) step with `batch` running requests, at draft
        depth `steps` on an adaptive server."""
        if self.adaptive is not None and steps is not None:
            return self.adaptive.speed.step_s(batch, steps) * self.time_scale
        t = self.speed.step_time(batch)
        if self.accept_length is not None:
            t *= self.accept_length
        return t * self.time_scale

    def step_depth(self, running: int) -> int:
        """The draft depth of a step with `running` requests (the profile's concurrency, which the
        step time follows too)."""
        if self.adaptive is not None:
            return self.adaptive.steps_for(running)
        return self.speculative_num_steps if self.speculative else 0

    # -- requests ----------------------------------------------------------------------

    def submit(self, req: EngineRequest) -> None:
        """Queue `req`; raises QueueFull when the waiting queue is at its bound."""
        if req.output_tokens < 1:
            raise ValueError("output_tokens must be >= 1")
        admit_now = len(self._running) < self.max_running_requests and not self._queue
        if not admit_now and self.max_queued_requests is not None:
            if len(self._queue) >= self.max_queued_requests:
                raise QueueFull("The request queue is full.")
        req.submitted_at = self._loop.time()
        self._queue.append(req)
        self._admit()

    def abort(self, rid: str) -> bool:
        """Abort a queued or running request; its client gets finish_reason "abort"."""
        req = self._running.get(rid)
        if req is None:
            req = next((r for r in self._queue if r.rid == rid), None)
            if req is None:
                return False
            self._queue.remove(req)
            self._finish(req, "abort")
            return True
        self._finish(req, "abort")
        self._admit()
        return True

    def abort_all(self) -> int:
        rids = [r.rid for r in self._queue] + list(self._running)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    # -- internals ---------------------------------------------------------------------

    def _admit(self) -> None:
        admitted = False
        hit = prompt = 0
        while self._queue and len(self._running) < self.max_running_requests:
            req = self._queue.popleft()
            now = self._loop.time()
            req.admitted_at = now
            self._running[req.rid] = req
            if self.cache is not None:
                req.cached_tokens, req._cache = self.cache.admit(req.blocks, req.prompt_tokens)
            hit += req.cached_tokens
            prompt += req.prompt_tokens
            b = len(self._running)
            prefill = self.speed.prefill_s(req.prompt_tokens - req.cached_tokens)
            ttft = (self.speed.ttft_s(b) + prefill) * self.time_scale
            req._timer = self._loop.call_at(now + ttft, self._first_token, req)
            if self.observer is not None:
                self.observer.on_admit(req, now - req.submitted_at)
            admitted = True
        if admitted:
            # SGLang logs stats on every prefill batch, the batch's cache hit rate among them
            self._refresh_stats(hit_rate=hit / prompt if prompt > 0 else 0.0)

    def _first_token(self, req: EngineRequest) -> None:
        req._timer = None
        if req.done:
            return
        now = self._loop.time()
        req.first_token_at = req.last_token_at = now
        req.generated = 1
        self.total_generated += 1
        self._win_tokens += 1
        req.events.put_nowait(Tokens(1, req.index))
        if self.observer is not None:
            self.observer.on_first_token(req, now - req.submitted_at)
        if req.generated >= req.output_tokens:
            self._finish(req, req.finish_reason)
            self._admit()
            return
        self._decoding[req.rid] = req
        self._wake.set()

    def _finish(self, req: EngineRequest, reason: FinishReason) -> None:
        if req.done:
            return
        req.done = True
        if req._timer is not None:
            req._timer.cancel()
            req._timer = None
        self._running.pop(req.rid, None)
        self._decoding.pop(req.rid, None)
        if self.cache is not None and req._cache is not None:
            # what was computed stays cached: the prompt, and the answer once prefill is done
            more = req.sequence_blocks
            started = req.first_token_at is not None
            self.cache.release(req._cache, more(req.generated) if more is not None and started else ())
            req._cache = None
        req.events.put_nowait(Finished(reason, req.index))
        if self.observer is not None:
            self.observer.on_finish(req, reason, self._loop.time() - req.submitted_at)
        if not self._running:
            self._refresh_stats(decode=self._steps_since_stats > 0)  # show an idle server as idle

    def _advance(self, batch: list[EngineRequest], steps: int, running: int) -> None:
        """End of one step at draft depth `steps` (chosen for `running` requests): every request
        that was decoding at its start gets its tokens."""
        now = self._loop.time()
        finished = False
        adaptive = self.adaptive
        drafts: list[int] = []
        for req in batch:
            if req.done:
                continue
            if self.accept_length is not None:
                if adaptive is not None:
                    j = adaptive.drafts(req.accept_mean, steps)
                    drafts.append(j)
                    k = 1 + j
                else:
                    k = self.sampler.sample(req.accept_mean)
                self.total_verify += 1
                self.total_accepted += k
                self._win_verify += 1
                self._win_accepted += k
                self._win_proposed += steps
                req.verify_ct += 1
                req.proposed_drafts += steps
            else:
                k = 1
            k = min(k, req.output_tokens - req.generated)
            if self.accept_length is not None:
                req.accepted_tokens += k
            req.generated += k
            self.total_generated += k
            self._win_tokens += k
            interval = now - (req.last_token_at or now)
            req.last_token_at = now
            req.events.put_nowait(Tokens(k, req.index))
            if self.observer is not None:
                self.observer.on_chunk(req, k, interval)
            if req.generated >= req.output_tokens:
                self._finish(req, req.finish_reason)
                finished = True
        if adaptive is not None:
            adaptive.observe(running, drafts)
        self.steps += 1
        self._steps_since_stats += 1
        if self._steps_since_stats >= self.stats_interval_steps:
            self._refresh_stats(decode=True)
        if finished:
            self._admit()

    def _refresh_stats(self, decode: bool = False, hit_rate: float | None = None) -> None:
        """Publish scheduler stats. Like SGLang: counts on every prefill batch (admission, with
        that batch's cache `hit_rate`); throughput and acceptance over the window since the last
        decode refresh."""
        now = self._loop.time()
        old = self.stats
        throughput, accept_len, accept_rate = old.gen_throughput, old.spec_accept_length, old.spec_accept_rate
        if decode:
            elapsed = now - self._win_start
            throughput = self._win_tokens / elapsed if elapsed > 0 else 0.0
            if self._win_verify:
                accept_len = self._win_accepted / self._win_verify
                proposed = self._win_proposed
                accept_rate = (self._win_accepted - self._win_verify) / proposed if proposed else 0.0
        if decode or not self._running:
            self._win_tokens = self._win_verify = self._win_accepted = self._win_proposed = 0
            self._win_start = now
            self._steps_since_stats = 0
        if not self._running:
            throughput = 0.0
        used = self.used_tokens()
        self.stats = SchedulerStats(
            timestamp=now,
            num_running_reqs=len(self._running),
            num_queue_reqs=len(self._queue),
            gen_throughput=throughput,
            spec_accept_length=accept_len,
            spec_accept_rate=accept_rate,
            spec_num_steps=self.adaptive.last_steps if self.adaptive is not None else self.step_depth(0),
            cache_hit_rate=old.cache_hit_rate if hit_rate is None else hit_rate,
            num_used_tokens=used,
            token_usage=round(used / self.max_total_num_tokens, 2),
        )
        if self.observer is not None:
            self.observer.on_stats(self.stats)

    async def _run(self) -> None:
        deadline: float | None = None
        while True:
            if not self._decoding:
                deadline = None
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self._loop.time()
            if deadline is None or now - deadline > _MAX_LAG_S:
                deadline = now
            batch = list(self._decoding.values())
            running = len(self._running)
            steps = self.step_depth(running)
            deadline += self.step_seconds(running, steps)
            delay = deadline - self._loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self._advance(batch, steps, running)
