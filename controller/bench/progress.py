"""Where a bench sweep is, and how long it still takes.

How the ETA works. A level of `c` closed-loop clients runs "rounds" of requests: with every
request lasting the same time D, the level takes `level_rounds(c, warmup, n)` x D (the warm-up
requests first, then the `n` measured ones; fillers keep the concurrency until the last measured
request ends), plus the drain: the fillers still in flight then run to their end, which takes
about D x (c - 1) / c more (their ages are spread over one request's time). D at a level not yet
run is predicted from the levels already run (`predict_e2e_s`): TTFT plus the output tokens
times a token's decode time, each a least-squares line in the concurrency (the decode step of a
batch grows about linearly with it); above the server's `max_running_requests` (when
`/server_info` tells it) the excess waits in the server's queue, so D grows with
c / max_running_requests. Within a running level the requests already
finished give D directly (and count as a point for the levels after it). Once every measured
request has started, the level's ETA is the time the requests in flight still need. The sweep's
ETA is the running level's plus the predicted levels after it.

`SweepProgress` keeps the counts the runner reports and renders them: a tqdm bar refreshed twice
a second on a terminal, a plain line every `line_interval_s` otherwise (logs get no bar).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

LINE_INTERVAL_S = 4.0
"""Seconds between progress lines when stderr is not a terminal (progress moves within 5 s)."""


def level_rounds(concurrency: int, warmup: int, n: int) -> int:
    """Rounds (request durations) a level takes when every request lasts the same time: the
    runner's rule replayed -- a request is warm-up while fewer than `warmup` have completed, the
    next `n` starts are measured, and the level ends when the last measured request has."""
    completed = started_measured = done_measured = 0
    phases = ["warmup" if warmup > 0 else "measured"] * concurrency
    if warmup == 0:
        started_measured = min(concurrency, n)
        phases = ["measured"] * started_measured + ["filler"] * (concurrency - started_measured)
    rounds = 0
    while done_measured < n:
        rounds += 1
        for i, phase in enumerate(phases):
            completed += 1
            if phase == "measured":
                done_measured += 1
            if completed < warmup:
                phases[i] = "warmup"
            elif started_measured < n:
                phases[i] = "measured"
                started_measured += 1
            else:
                phases[i] = "filler"
    return rounds


PRIOR_DOUBLING_CLIENTS = 7.0
"""With one level run, a token's decode time is assumed to grow by its own value every this many
clients (the built-in Kimi profile: x2 at 10 clients plain, x3.3 EAGLE-3); from two levels on,
the levels say."""


STEP_SPREAD_FLOOR = 0.03
"""The least relative spread of per-request decode steps assumed when weighting a level."""
SETTLED_REQUESTS = 10
SETTLED_ROUNDS = 2
"""A running level speaks for itself (its mean e2e, its point for the later levels) once it has
finished at least SETTLED_REQUESTS requests and SETTLED_ROUNDS x its concurrency: its first
finishers are its shortest requests, and its first round starts all at once (prefills collide),
either of which would misstate it."""


@dataclass(frozen=True)
class LevelPoint:
    """What a level run says about the server at its concurrency."""

    concurrency: int
    ttft_s: float
    """Mean time to first token."""
    step_s: float
    """Seconds per output token after the first (token-weighted over the requests)."""
    step_rel_var: float
    """Variance of `step_s` relative to its square (weights the fit: noisy levels count less)."""
    tokens: float
    """Mean output tokens of a request."""

    @property
    def e2e_s(self) -> float:
        return self.ttft_s + max(self.tokens - 1.0, 0.0) * self.step_s


def level_point(concurrency: int, requests: Iterable[Any]) -> LevelPoint | None:
    """The point of a level from its finished requests (objects with `ok`, `ttft_s`,
    `first_token_s`, `last_token_s` and `completion_tokens`, as `RequestResult`); None without
    a request that decoded two tokens."""
    ttfts, tokens, steps = [], [], []
    spent = decoded = 0.0
    for r in requests:
        if not r.ok or r.ttft_s is None:
            continue
        ttfts.append(r.ttft_s)
        n = r.completion_tokens or 0
        tokens.append(float(n))
        if n > 1 and r.first_token_s is not None and r.last_token_s is not None:
            spent += r.last_token_s - r.first_token_s
            decoded += n - 1
            steps.append((r.last_token_s - r.first_token_s) / (n - 1))
    if not decoded or spent <= 0:
        return None
    step = spent / decoded
    mean = sum(steps) / len(steps)
    var = sum((x - mean) ** 2 for x in steps) / len(steps) / len(steps)
    # a few requests can agree by chance: never trust a level more than a 3% spread would allow
    rel_var = max(var / step**2, STEP_SPREAD_FLOOR**2 / len(steps))
    return LevelPoint(concurrency, sum(ttfts) / len(ttfts), step, rel_var, sum(tokens) / len(tokens))


def _line(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> Callable[[float], float]:
    """Weighted least squares, slope at least 0."""
    total = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / total
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True))
    slope = max(0.0, sxy / sxx) if sxx > 0 else 0.0
    return lambda c: my + slope * (c - mx)


def predict_e2e_s(points: Sequence[LevelPoint], concurrency: int, cap: int | None = None) -> float | None:
    """Mean end-to-end seconds at `concurrency` from the levels already run; None when none is.

    e2e = TTFT + (tokens - 1) x step, with TTFT and the per-token step each a line in the
    concurrency (least squares; the step weighted by how precisely each level measured it), the
    tokens the mean over the levels; with one level the step grows as `PRIOR_DOUBLING_CLIENTS`
    says. Beyond the server's `max_running_requests` (`cap`) its throughput is flat: e2e grows
    with the clients in line, from the largest level at or above the cap, else the cap's."""
    if not points:
        return None
    exact = [p for p in points if p.concurrency == concurrency]
    if exact:
        return exact[-1].e2e_s
    if cap is not None and concurrency > cap:
        above = sorted((p for p in points if p.concurrency >= cap), key=lambda p: p.concurrency)
        if above:
            return above[-1].e2e_s * concurrency / above[-1].concurrency
        at_cap = predict_e2e_s(points, cap)
        return None if at_cap is None else at_cap * concurrency / cap
    # levels beyond the cap queue: their TTFT and step say nothing of the batch below it
    below = [p for p in points if cap is None or p.concurrency <= cap] or list(points)
    tokens = sum(p.tokens for p in points) / len(points)
    if len(below) == 1:
        (p,) = below
        step = p.step_s * max(1.0 + (concurrency - p.concurrency) / PRIOR_DOUBLING_CLIENTS, 0.0)
        return p.ttft_s + max(tokens - 1.0, 0.0) * step
    xs = [float(p.concurrency) for p in below]
    ttft = _line(xs, [p.ttft_s for p in below], [1.0] * len(below))(concurrency)
    weights = [1.0 / max(p.step_rel_var, 1e-6) for p in below]
    step = _line(xs, [p.step_s for p in below], weights)(concurrency)
    return max(ttft, 0.0) + max(tokens - 1.0, 0.0) * max(step, 0.0)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


@dataclass
class LevelState:
    """What one running level has done so far (the runner updates it)."""

    concurrency: int
    index: int
    """0-based position of the level in the sweep."""
    target: int
    warmup: int
    started_at: float
    in_flight: int = 0
    warmup_done: int = 0
    measured_started: int = 0
    measured_done: int = 0
    fillers_done: int = 0
    e2e_sum_s: float = 0.0
    e2e_n: int = 0
    finished: list[Any] = field(default_factory=list)
    """The requests finished so far (the runner's results), for the level's provisional point."""
    measured_starts: dict[int, float] = field(default_factory=dict)
    """Start time of every measured request still in flight, by a request key."""
    starts: dict[int, float] = field(default_factory=dict)
    """Start time of every request still in flight (any phase), by a request key."""

    @property
    def all_started(self) -> bool:
        """Every measured request has started: what is left is waiting for them (and the drain)."""
        return self.measured_started >= self.target

    @property
    def phase(self) -> str:
        if self.measured_started == 0 and self.warmup:
            return "warm-up"
        if self.measured_done >= self.target:
            return "draining"  # the fillers still in flight run to their end
        return "finishing" if self.all_started else "measuring"


class SweepProgress:
    """Progress and ETA of a sweep (see the module docstring). `clock` gives seconds."""

    def __init__(
        self,
        levels: Sequence[int],
        *,
        requests_per_level: int,
        warmup: int,
        label: str | None,
        clock: Callable[[], float],
        enabled: bool = True,
        stream: TextIO | None = None,
        line_interval_s: float = LINE_INTERVAL_S,
    ) -> None:
        self.levels = tuple(levels)
        self.n = requests_per_level
        self.warmup = warmup
        self.label = label
        self.clock = clock
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.line_interval_s = line_interval_s
        self.cap: int | None = None
        """The server's max_running_requests, when known."""
        self.known: list[LevelPoint] = []
        """What the finished levels said."""
        self.level: LevelState | None = None
        self.sweep_started = clock()
        self._bar: Any = None
        self._last_line = -math.inf
        self.lines: list[str] = []
        """The plain lines written (non-terminal), for tests and logs."""

    # -- the runner's reports --

    def start_level(self, concurrency: int) -> LevelState:
        index = self.levels.index(concurrency)
        self.level = LevelState(concurrency, index, self.n, self.warmup, self.clock())
        self._last_line = -math.inf  # a new level is news: its first tick writes a line
        if self.enabled and self.tty:
            from tqdm import tqdm

            desc = f"{self.label}: concurrency {concurrency}" if self.label else f"concurrency {concurrency}"
            self._bar = tqdm(total=self.n, desc=desc, file=self.stream, leave=False, unit="req")
        return self.level

    def end_level(self, point: LevelPoint | None) -> None:
        if point is not None:
            self.known.append(point)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.level = None

    # -- the estimates --

    def _settled(self) -> bool:
        lv = self.level
        return lv is not None and len(lv.finished) >= max(SETTLED_REQUESTS, SETTLED_ROUNDS * lv.concurrency)

    def _points(self) -> list[LevelPoint]:
        """The finished levels' points, plus the running level's so far once it has settled (or
        while it is the first)."""
        lv = self.level
        settled = self._settled() or not self.known  # the first level: better early than nothing
        here = level_point(lv.concurrency, lv.finished) if lv is not None and settled else None
        return [*self.known, here] if here is not None else list(self.known)

    def _rounds(self, concurrency: int) -> float:
        return level_rounds(concurrency, self.warmup, self.n) + (concurrency - 1) / concurrency

    def level_duration_s(self, concurrency: int) -> float | None:
        d = predict_e2e_s(self._points(), concurrency, self.cap)
        return None if d is None else d * self._rounds(concurrency)

    def level_eta_s(self) -> float | None:
        lv = self.level
        if lv is None:
            return None
        now = self.clock()
        if lv.e2e_n and (self._settled() or not self.known):
            d: float | None = lv.e2e_sum_s / lv.e2e_n
        else:
            d = predict_e2e_s(self.known, lv.concurrency, self.cap)
        if d is None:
            return None
        # the requests in flight need at least the rest of their time
        floor = max([d - (now - t) for t in lv.starts.values()] + [0.0])
        if lv.measured_done >= lv.target:
            return floor
        if lv.all_started:
            last = max([d - (now - t) for t in lv.measured_starts.values()] + [0.0])
            return max(floor, last + d * (lv.concurrency - 1) / lv.concurrency)
        return max(floor, d * self._rounds(lv.concurrency) - (now - lv.started_at))

    def sweep_eta_s(self) -> float | None:
        lv = self.level
        here = self.level_eta_s() if lv is not None else 0.0
        if here is None:
            return None
        start = lv.index + 1 if lv is not None else len(self.known)
        rest = 0.0
        for c in self.levels[start:]:
            t = self.level_duration_s(c)
            if t is None:
                return None
            rest += t
        return here + rest

    # -- rendering --

    def status(self) -> str:
        lv = self.level
        if lv is None:
            return ""
        warm = f", warm-up {lv.warmup_done}/{lv.warmup}" if lv.warmup and lv.measured_started == 0 else ""
        return (
            f"level {lv.index + 1}/{len(self.levels)} concurrency {lv.concurrency} {lv.phase}: "
            f"measured {lv.measured_done}/{lv.target} done ({lv.measured_started} started){warm}, "
            f"{lv.in_flight} in flight, {lv.fillers_done} filler done; "
            f"ETA level {fmt_duration(self.level_eta_s())}, sweep {fmt_duration(self.sweep_eta_s())}"
        )

    def tick(self) -> None:
        """Refresh the display (the runner calls it twice a second and on each completion)."""
        if not self.enabled or self.level is None:
            return
        if self._bar is not None:
            lv = self.level
            self._bar.n = lv.measured_done
            self._bar.set_postfix_str(
                f"{lv.phase}, {lv.in_flight} in flight, ETA level {fmt_duration(self.level_eta_s())} "
                f"sweep {fmt_duration(self.sweep_eta_s())}",
                refresh=True,
            )
            return
        now = self.clock()
        if now - self._last_line >= self.line_interval_s:
            self._last_line = now
            who = f"{self.label}: " if self.label else ""
            line = f"bench {who}{self.status()}"
            self.lines.append(line)
            print(line, file=self.stream, flush=True)
