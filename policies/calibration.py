"""Learning from outcomes: bounded estimates that converge, shared by the adaptive policies.

- `ShrunkMean`: the mean of the samples shrunk toward a prior, `(w * prior + sum x) / (w + n)`,
  until `1 / (w + n)` falls to `1 / window`; from then on an exponentially weighted mean that
  remembers about `window` samples. The prior weight `w` (in samples) keeps one sample from
  moving a young estimate far; the window lets an old one follow a drift.
- `HintSlots`: per-hint state in a bounded number of slots, with an eviction rule so that a
  client inventing tags cannot take the slots of the hints in regular use (see the class).
- `SpeedCalibration`: `cost_model`'s correction of its speed profile. It learns, in log space,
  `log(observed decode rate / profile's)`: per pool a mean over all of the pool's untagged
  outcomes, per (pool, load bucket) the mean of that bucket's own outcomes, and per eagle hint
  (`x-specroute-hint`: the drafter's acceptance depends on the domain) the mean of that tag's
  outcomes (each mean a `ShrunkMean` remembering `window` samples). A bucket's estimate is its
  own mean blended with the pool's, `(n * bucket + 2w * pool) / (n + 2w)` (n: the samples it
  has had): a uniform drift is learned from every outcome at once, a load-dependent one bucket
  by bucket as evidence comes in. A tagged request is predicted by its tag's mean plus the
  bucket's deviation from the pool's; each tag has its own term, so what one tag teaches never
  moves another's prediction and traffic of one tag cannot push the other back and forth
  between the pools. With
  per-request acceptance from the backend (SGLang's `spec_tokens_details`), the tags (and
  untagged requests) learn their acceptance from it directly and the pool and bucket means the
  rate with the acceptance divided out. A sample is clipped to within a factor `clip` of the
  current estimate, and a pool's mean starts from the profile with a weight of `w` samples, so
  one outlier moves a prediction by at most `log(clip) * (1/(w+1) + w/((w+1)(2w+1)))` in log
  space (4% with the defaults clip = 1.5 and w = 10; 6% as a bucket's first sample), while a
  drift of any size is still followed; a whole estimate is bounded to `[1/4, 4]` times the
  profile. With the defaults (window 200) a uniform drift of 20% is learned to 2% within about
  100 outcomes of the pool (see `benchmarks/decision_quality.py`, section 6).

  A wrong profile (another model, engine or machine) is a different matter: clipping and the
  prior make every estimate move slowly, and the bound `[1/4, 4]` may not even reach the truth.
  So each pool also keeps the unclipped log ratios of its last `MISMATCH_WINDOW` untagged outcomes
  (acceptance divided out as above); once it has had
  `MISMATCH_AFTER` outcomes since it was last rebased and their median is more than a factor
  `MISMATCH_FACTOR` (2) away from the pool's estimate, the pool is *rebased*: its mean jumps to
  that median, its load buckets start over, the bound widens to `[1/64, 64]`, and the event is
  counted in `mismatches` (with the factor in `mismatch_factor`) for the proxy to report. A
  median of two dozen outcomes is not moved by a few outliers, and a profile within 2x of the
  truth is never rebased (it is learned as before).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from typing import Any, Generic, TypeVar

from policies.base import Pool
from policies.learned import StateError, check_version, count, field, items, number, numbers

T = TypeVar("T")

_MAX_LOG_SCALE = math.log(4.0)
_REBASED_LOG_SCALE = math.log(64.0)
MISMATCH_WINDOW = 32
"""Unclipped outcomes per pool the mismatch check looks at (the latest)."""
MISMATCH_AFTER = 24
"""Outcomes of a pool (since its last rebase) before a mismatch may be declared."""
MISMATCH_FACTOR = 2.0
"""How far (as a factor) the recent median must be from the estimate to rebase the pool."""
_MISMATCH_LOG = math.log(MISMATCH_FACTOR)
STATE_VERSION = 1
"""The layout of `SpeedCalibration.state()`."""


class ShrunkMean:
    """A mean shrunk toward its prior that turns into an EWMA over `window` samples (see the
    module docstring). `n` counts the samples."""

    __slots__ = ("n", "value")

    def __init__(self, prior: float = 0.0) -> None:
        self.n = 0
        self.value = prior

    def add(self, x: float, prior_weight: float, window: float) -> None:
        self.n += 1
        w = 1.0 / (self.n + prior_weight)
        floor = 1.0 / window
        self.value += (w if w > floor else floor) * (x - self.value)


class HintSlots(Generic[T]):
    """Per-hint state in at most `capacity` slots.

    `teach(hint)` is called once per outcome that teaches the hint and returns its state. A hint
    without a slot gets a free one, or takes over the slot of the hint seen longest ago if that
    hint has not been seen in the last `idle_after` teaching outcomes; otherwise it is not
    tracked (its requests are predicted as untagged ones). A hint in regular use therefore keeps
    its slot however many new tags clients send, and a slot whose hint went quiet is freed.
    """

    __slots__ = ("_clock", "_idle_after", "_make", "_slots", "capacity")

    def __init__(self, capacity: int, idle_after: int, make: Callable[[str], T]) -> None:
        self.capacity = capacity
        self._idle_after = idle_after
        self._make = make
        self._slots: dict[str, tuple[int, T]] = {}
        self._clock = 0

    def get(self, hint: str) -> T | None:
        slot = self._slots.get(hint)
        return None if slot is None else slot[1]

    def teach(self, hint: str) -> T | None:
        self._clock += 1
        slot = self._slots.get(hint)
        if slot is not None:
            self._slots[hint] = (self._clock, slot[1])
            return slot[1]
        if len(self._slots) >= self.capacity:
            if not self._slots:
                return None
            oldest = min(self._slots, key=lambda h: self._slots[h][0])
            if self._clock - self._slots[oldest][0] <= self._idle_after:
                return None
            del self._slots[oldest]
        state = self._make(hint)
        self._slots[hint] = (self._clock, state)
        return state

    def items(self) -> list[tuple[str, T]]:
        return sorted((hint, slot[1]) for hint, slot in self._slots.items())

    def snapshot(self, encode: Callable[[T], list[Any]]) -> dict[str, Any]:
        """The slots as plain data (`policies.learned`), each `[hint, last seen, *encode(state)]`
        in slot order (which eviction's ties follow)."""
        return {
            "clock": self._clock,
            "slots": [[h, seen, *encode(s)] for h, (seen, s) in self._slots.items()],
        }

    def restored(self, data: object, width: int, decode: Callable[[list[Any]], T]) -> dict[str, Any]:
        """Check `snapshot` data (`width`: the length of `encode`'s lists; `decode` raises
        StateError) and return what `restore` assigns; nothing is changed here."""
        what = "hint slots"
        if not isinstance(data, dict):
            raise StateError(f"{what}: expected an object")
        clock = count(field(data, "clock", what), what)
        slots: dict[str, tuple[int, T]] = {}
        for row in items(field(data, "slots", what), what, width + 2):
            hint, seen = row[0], count(row[1], what)
            if not isinstance(hint, str) or hint in slots or seen > clock:
                raise StateError(f"{what}: a slot's hint or clock is not valid")
            slots[hint] = (seen, decode(row[2:]))
        if len(slots) > self.capacity:
            raise StateError(f"{what}: {len(slots)} slots where {self.capacity} fit (other parameters?)")
        return {"clock": clock, "slots": slots}

    def restore(self, checked: dict[str, Any]) -> None:
        """Assign what `restored` checked."""
        self._clock = checked["clock"]
        self._slots = checked["slots"]


def check_bounds(bounds: list[int]) -> list[int]:
    """Load-bucket upper bounds: positive and strictly increasing (a pydantic validator)."""
    if bounds[0] < 1 or any(b <= a for a, b in pairwise(bounds)):
        raise ValueError("must be positive and strictly increasing")
    return bounds


def _clipped(x: float, bound: float) -> float:
    return bound if x > bound else -bound if x < -bound else x


class SpeedCalibration:
    """Speed scale per (pool, load bucket) and per eagle hint; see the module docstring."""

    def __init__(
        self,
        bounds: Sequence[int],
        *,
        window: int,
        prior_weight: float,
        clip: float,
        max_hints: int,
        hint_idle: int,
        hint_priors: Mapping[str, float] | None = None,
        accept_length: float | None = None,
    ) -> None:
        self._bucket_of = [bisect_left(bounds, b) for b in range(bounds[-1] + 1)]
        self._last_bucket = len(bounds)
        self._window = float(window)
        self._prior = prior_weight
        self._bucket_prior = 2.0 * prior_weight
        self._clip = math.log(clip)
        priors = {h: math.log(f) for h, f in (hint_priors or {}).items()}
        self._hint_priors = priors
        self.pool: dict[Pool, ShrunkMean] = {"baseline": ShrunkMean(), "eagle": ShrunkMean()}
        self.buckets: dict[Pool, list[ShrunkMean]] = {
            p: [ShrunkMean() for _ in range(len(bounds) + 1)] for p in ("baseline", "eagle")
        }
        # a bucket's blend is own_part + pool_weight * pool mean: kept per bucket so a lookup is
        # two list reads (an outcome changes its own bucket's pair only)
        self._own_part: dict[Pool, list[float]] = {
            p: [0.0] * (len(bounds) + 1) for p in ("baseline", "eagle")
        }
        self._pool_weight: dict[Pool, list[float]] = {
            p: [1.0] * (len(bounds) + 1) for p in ("baseline", "eagle")
        }
        self._accept_ref = math.log(accept_length) if accept_length else None
        self._accept_mean = ShrunkMean()
        self.accept_reported = False
        """Whether outcomes carried the backend's per-request acceptance."""
        self.untagged = ShrunkMean()
        """Acceptance of untagged requests, when the backend reports it (log, vs the profile's)."""
        self.hints: HintSlots[ShrunkMean] = HintSlots(max_hints, hint_idle, self._new_hint)
        self._max_log = _MAX_LOG_SCALE
        self._recent: dict[Pool, deque[float]] = {
            p: deque(maxlen=MISMATCH_WINDOW) for p in ("baseline", "eagle")
        }
        self._ordered: dict[Pool, list[float]] = {"baseline": [], "eagle": []}
        """The values of `_recent` in ascending order (equal values in arrival order, as a stable
        sort leaves them): the median is a read, not a sort per outcome."""
        self._since_rebase: dict[Pool, int] = {"baseline": 0, "eagle": 0}
        self.mismatches: dict[Pool, int] = {"baseline": 0, "eagle": 0}
        """Times each pool was rebased because the profile was off by more than 2x."""
        self.mismatch_factor: dict[Pool, float | None] = {"baseline": None, "eagle": None}
        """Observed over profiled speed at the latest rebase of each pool (None: never)."""

    def _new_hint(self, hint: str) -> ShrunkMean:
        """A tag's term starts where the tag is known to be (`hint_speedup`) on top of where
        untagged requests are."""
        told = self._hint_priors.get(hint, 0.0)
        if self.accept_reported:  # the term is the tag's acceptance against the profile's
            return ShrunkMean(told if hint in self._hint_priors else self.untagged.value)
        return ShrunkMean(self.pool["eagle"].value + told)

    def bucket(self, batch: int) -> int:
        table = self._bucket_of
        return table[batch] if batch < len(table) else self._last_bucket

    def _blend(self, pool: Pool, batch: int) -> float:
        table = self._bucket_of
        k = table[batch] if batch < len(table) else self._last_bucket
        return self._own_part[pool][k] + self._pool_weight[pool][k] * self.pool[pool].value

    def log_speed(self, pool: Pool, batch: int) -> float:
        """log of the speed scale of `pool` (for untagged requests) with `batch` running."""
        return _clipped(self._blend(pool, batch), self._max_log)

    def speed(self, pool: Pool, batch: int) -> float:
        """The speed scale of `pool` (for untagged requests) with `batch` running."""
        table = self._bucket_of
        k = table[batch] if batch < len(table) else self._last_bucket
        x = self._own_part[pool][k] + self._pool_weight[pool][k] * self.pool[pool].value
        bound = self._max_log
        return math.exp(bound if x > bound else -bound if x < -bound else x)

    def log_hint(self, hint: str | None) -> float:
        """log of a request's own eagle speed factor on top of `log_speed("eagle", ...)`: its
        tag's speed relative to untagged requests, or, when the backend reports acceptance, its
        tag's (or untagged requests') acceptance relative to the profile's."""
        state = self.hints.get(hint) if hint is not None else None
        if self.accept_reported:
            if state is not None:
                return state.value
            told = self._hint_priors.get(hint) if hint is not None else None
            return self.untagged.value if told is None else told
        if state is not None:
            return _clipped(state.value - self.pool["eagle"].value, self._max_log)
        return self._hint_priors.get(hint, 0.0) if hint is not None else 0.0

    def observe(
        self, pool: Pool, batch: int, hint: str | None, rate_ratio: float, accept_length: float | None
    ) -> None:
        """Learn from one outcome: its decode rate over the profile's at `batch` (without any
        acceptance factor), and the acceptance the backend reported (eagle), if any."""
        if not 0.0 < rate_ratio < math.inf:
            return
        prior, window, clip = self._prior, self._window, self._clip
        x = math.log(rate_ratio)
        table = self._bucket_of
        k = table[batch] if batch < len(table) else self._last_bucket
        g = self.pool[pool]
        own_part, pool_weight = self._own_part[pool], self._pool_weight[pool]
        if pool == "eagle" and accept_length is not None and accept_length > 0.0:
            self.accept_reported = True
            a = math.log(accept_length)
            if self._accept_ref is None:
                self._accept_mean.add(a, 0.0, window)
                a -= self._accept_mean.value
            else:
                a -= self._accept_ref
            state = self.hints.teach(hint) if hint is not None else None
            target = state if state is not None else self.untagged
            a = _near(a, target.value, clip)
            target.add(a, prior, window)
            x -= a  # the pool and bucket means learn the rate with the acceptance divided out
        elif pool == "eagle" and hint is not None:
            state = self.hints.teach(hint)
            if state is not None:  # the tag's own mean, at the load bucket's deviation
                x -= own_part[k] + (pool_weight[k] - 1.0) * g.value
                state.add(_near(x, state.value, clip), prior, window)
                return
        # the untagged case, inlined (the hot path): the mismatch check (rebase `pool` when its
        # recent outcomes' median is more than MISMATCH_FACTOR from its estimate), clip near the
        # estimate, then both means (`ShrunkMean.add` inlined)
        recent, ordered = self._recent[pool], self._ordered[pool]
        if len(recent) == MISMATCH_WINDOW:
            # the oldest value leaves: among its equals it is the first (insort puts a new value
            # after its equals), so `ordered` stays exactly `sorted(recent)`
            del ordered[bisect_left(ordered, recent[0])]
        recent.append(x)
        insort(ordered, x)
        since = self._since_rebase[pool] = self._since_rebase[pool] + 1
        if since >= MISMATCH_AFTER:
            mid = len(ordered) // 2
            median = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
            if abs(median - g.value) > _MISMATCH_LOG:
                self._rebase(pool, median)
        estimate = own_part[k] + pool_weight[k] * g.value
        if x > estimate + clip:
            x = estimate + clip
        elif x < estimate - clip:
            x = estimate - clip
        gn = g.n = g.n + 1
        w = 1.0 / (gn + prior)
        floor = 1.0 / window
        g.value += (w if w > floor else floor) * (x - g.value)
        own = self.buckets[pool][k]
        n = own.n = own.n + 1
        w = 1.0 / n
        own.value += (w if w > 1.0 / window else 1.0 / window) * (x - own.value)
        weight = n + self._bucket_prior
        own_part[k] = n * own.value / weight
        pool_weight[k] = self._bucket_prior / weight

    def _rebase(self, pool: Pool, median: float) -> None:
        """The profile is off for `pool`: its mean jumps to the recent median, its buckets start
        over, the bound widens (see the module docstring)."""
        self._max_log = _REBASED_LOG_SCALE
        target = _clipped(median, _REBASED_LOG_SCALE)
        self.pool[pool].value = target
        for own in self.buckets[pool]:
            own.n, own.value = 0, 0.0
        self._own_part[pool] = [0.0] * len(self._own_part[pool])
        self._pool_weight[pool] = [1.0] * len(self._pool_weight[pool])
        self._since_rebase[pool] = 0
        self._recent[pool].clear()
        self._ordered[pool].clear()
        self.mismatches[pool] += 1
        self.mismatch_factor[pool] = math.exp(target)

    # What it learned, as plain data (`policies.learned`): every estimate as it stands, so a
    # loaded calibration predicts exactly as the saved one did. The parameters (buckets, window,
    # priors, the profile's accept length) are the policy's, not part of the state.

    def state(self) -> dict[str, Any]:
        def pair(m: ShrunkMean) -> list[Any]:
            return [m.n, m.value]

        return {
            "version": STATE_VERSION,
            "pool": {p: pair(m) for p, m in self.pool.items()},
            "buckets": {p: [pair(m) for m in ms] for p, ms in self.buckets.items()},
            "own_part": {p: list(v) for p, v in self._own_part.items()},
            "pool_weight": {p: list(v) for p, v in self._pool_weight.items()},
            "accept_mean": pair(self._accept_mean),
            "accept_reported": self.accept_reported,
            "untagged": pair(self.untagged),
            "hints": self.hints.snapshot(pair),
            "max_log": self._max_log,
            "recent": {p: list(d) for p, d in self._recent.items()},
            "since_rebase": dict(self._since_rebase),
            "mismatches": dict(self.mismatches),
            "mismatch_factor": dict(self.mismatch_factor),
        }

    def load_state(self, state: object) -> None:
        what = "calibration"
        s = check_version(state, what, STATE_VERSION)
        size = len(self.buckets["baseline"])

        def mean(x: object) -> ShrunkMean:
            if not isinstance(x, list) or len(x) != 2:
                raise StateError(f"{what}: expected [samples, value], got {x!r}"[:200])
            m = ShrunkMean(number(x[1], what))
            m.n = count(x[0], what)
            return m

        def per_pool(key: str) -> dict[Pool, Any]:
            value = field(s, key, what)
            if not isinstance(value, dict) or sorted(value) != ["baseline", "eagle"]:
                raise StateError(f"{what}: {key} must have the baseline and eagle pools")
            return {"baseline": value["baseline"], "eagle": value["eagle"]}

        pools: dict[Pool, ShrunkMean] = {p: mean(v) for p, v in per_pool("pool").items()}
        buckets: dict[Pool, list[ShrunkMean]] = {}
        for p, ms in per_pool("buckets").items():
            if not isinstance(ms, list) or len(ms) != size:
                raise StateError(f"{what}: {p} has other load buckets than this policy's (other parameters?)")
            buckets[p] = [mean(m) for m in ms]
        own = {p: numbers(v, what, size) for p, v in per_pool("own_part").items()}
        weight = {p: numbers(v, what, size) for p, v in per_pool("pool_weight").items()}
        recent: dict[Pool, deque[float]] = {}
        for p, v in per_pool("recent").items():
            values = numbers(v, what)
            if len(values) > MISMATCH_WINDOW:
                raise StateError(f"{what}: more recent outcomes than the mismatch window")
            recent[p] = deque(values, maxlen=MISMATCH_WINDOW)
        since = {p: count(v, what) for p, v in per_pool("since_rebase").items()}
        mismatches = {p: count(v, what) for p, v in per_pool("mismatches").items()}
        factors = {p: None if v is None else number(v, what) for p, v in per_pool("mismatch_factor").items()}
        max_log = number(field(s, "max_log", what), what)
        if max_log not in (_MAX_LOG_SCALE, _REBASED_LOG_SCALE):
            raise StateError(f"{what}: max_log is neither bound")
        reported = field(s, "accept_reported", what)
        if not isinstance(reported, bool):
            raise StateError(f"{what}: accept_reported must be true or false")
        accept_mean, untagged = mean(field(s, "accept_mean", what)), mean(field(s, "untagged", what))
        hints = self.hints.restored(field(s, "hints", what), 2, mean)
        # all checked: assign
        self.pool, self.buckets = pools, buckets
        self._own_part, self._pool_weight = own, weight
        self._recent = recent
        self._ordered = {p: sorted(d) for p, d in recent.items()}
        self._since_rebase, self.mismatches, self.mismatch_factor = since, mismatches, factors
        self._max_log = max_log
        self.accept_reported = reported
        self._accept_mean, self.untagged = accept_mean, untagged
        self.hints.restore(hints)


def _near(x: float, estimate: float, bound: float) -> float:
    """`x` clipped to `estimate +- bound`: an outlier pulls an estimate at most that far, while a
    real drift of any size is still followed, `bound` per sample at most."""
    return estimate + _clipped(x - estimate, bound)
