"""Where a bench sweep is, and how long it still takes.

How the ETA works. A level of `c` closed-loop clients runs "rounds" of requests: with every
request lasting the same time D, the level takes `level_rounds(c, warmup, n)` x D (the warm-up
requests first, then the `n` measured ones; fillers keep the concurrency until the last measured
request ends), plus the drain: the fillers still in flight then run to their end, which takes
about D x (c - 1) / c more (their ages are spread over one request's time). D at a level not yet
run is predicted from the mean end-to-end times of the levels already run: a least-squares line
in the concurrency (the decode step time of a batch grows about linearly with it; `PRIOR_*`
adds a typical point while only small levels have run), and above the server's
`max_running_requests` (when `/server_info` tells it) the excess waits in the server's queue,
so D grows with c / max_running_requests. Within a running level the requests already
finished give D directly (and count as a point for the levels after it). Once every measured
request has started, the level's ETA is the time the requests in flight still need. The sweep's
ETA is the running level's plus the predicted levels after it.

`SweepProgress` keeps the counts the runner reports and renders them: a tqdm bar refreshed twice
a second on a terminal, a plain line every `line_interval_s` otherwise (logs get no bar).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
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


PRIOR_CLIENTS = 20
PRIOR_FACTOR = 3.0
"""Until a level of at least PRIOR_CLIENTS more clients than the lowest has run, the fit also
gets a made-up point: PRIOR_FACTOR x the lowest level's e2e at PRIOR_CLIENTS more clients (on
the built-in Kimi profile a request's decode rate halves about every 10 clients). Without it
the first ETA would assume a flat curve, and the second extrapolate the noise of two points."""


def predict_e2e_s(
    known: Sequence[tuple[int, float]], concurrency: int, cap: int | None = None
) -> float | None:
    """Mean end-to-end seconds at `concurrency` from (concurrency, mean e2e) of the levels already
    run; None when none is known. See the module docstring for the rule."""
    pts = sorted(dict(known).items())
    if not pts:
        return None
    if concurrency in dict(pts):
        return dict(pts)[concurrency]
    if cap is not None and concurrency > cap:
        # Beyond the cap the server's throughput is flat: e2e grows with the clients in line.
        above = [p for p in pts if p[0] >= cap]
        c0, d0 = above[-1] if above else (cap, _fit(pts, cap))
        return d0 * concurrency / c0
    return _fit(pts, concurrency)


def _fit(pts: Sequence[tuple[int, float]], c: float) -> float:
    """A least-squares line through the points (plus the prior point while the levels run are
    all small), slope at least 0; beyond the largest level never below its value."""
    (first_c, first_d), (last_c, last_d) = pts[0], pts[-1]
    fit = list(pts)
    if last_c < first_c + PRIOR_CLIENTS:
        fit.append((first_c + PRIOR_CLIENTS, PRIOR_FACTOR * first_d))
    xs, ys = [float(x) for x, _ in fit], [y for _, y in fit]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx) if sxx else 0.0
    line = my + slope * (c - mx)
    return max(line, last_d) if c > last_c else max(line, 0.0)


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
        self.known: list[tuple[int, float]] = []
        """(concurrency, mean e2e s) of the finished levels."""
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

    def end_level(self, mean_e2e_s: float | None) -> None:
        if self.level is not None and mean_e2e_s is not None:
            self.known.append((self.level.concurrency, mean_e2e_s))
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.level = None

    # -- the estimates --

    def _points(self) -> list[tuple[int, float]]:
        """The finished levels' (concurrency, mean e2e), plus the running level's so far."""
        lv = self.level
        if lv is not None and lv.e2e_n:
            return [*self.known, (lv.concurrency, lv.e2e_sum_s / lv.e2e_n)]
        return list(self.known)

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
        d = lv.e2e_sum_s / lv.e2e_n if lv.e2e_n else predict_e2e_s(self.known, lv.concurrency, self.cap)
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
