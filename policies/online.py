"""`online`: learn each pool's speed under load from the requests it routes.

How it works: every finished request this policy routed is filed under its pool and its load
bucket (the load of the chosen backend when it was chosen, plus the request itself). Per
bucket the policy keeps moving means of the observed decode rate (`Outcome.decode_tok_s`,
divided by the request's hint factor), its spread, and the TTFT's wait: the TTFT less the
prefill of the request's uncached prompt tokens, which is learned per pool as seconds per
prompt token (from requests of at least `min_prefill_tokens` uncached tokens). So a request's
TTFT is predicted as its bucket's wait plus its own prefill: one huge prompt teaches how fast
prompts prefill, not that the pool is slow for everyone.

Each moving mean (`_Robust`) is a plain mean of its first samples, then remembers `1/alpha`
samples; once trusted, a sample is clipped to within a factor `clip` of the estimate (a wait
plus `WAIT_FLOOR_S`), so one outlier moves it by at most `log(clip) * alpha` in log space,
and when most of its latest `RECENT` samples lie beyond that factor on one side the estimate is
rebased to their median, so a real change is followed after a handful of outcomes.

To decide, each pool's estimate at its least-loaded backend's bucket predicts this request's
end-to-end time (or TTFT); the smaller wins. A bucket is trusted once it holds `min_samples`
samples; before that the speed profile answers (if one is given), or an optimistic prior that
makes unexplored buckets attractive so they get explored.

Exploration happens near the decision boundary and fades with confidence: a request is sent
to the other pool (with probability `epsilon`, seeded RNG) only when the two predictions are
within `explore_z` standard errors of each other (the errors shrink as the buckets fill), or
when one of the two buckets is not confident -- untrusted, or not sampled for so long that its
weight (in samples; it halves every `stale_half_life` decisions) is below one sample. And a
pool the policy has not learned from for `resample_s` seconds and `resample_every` decisions
gets the next request (reason `explore`): a pool that looks slow is re-sampled, so a recovery
(say, of EAGLE acceptance) or a wrong estimate is noticed. A re-sample that confirms the
estimate doubles the span (up to `MAX_BACKOFF` times), so a pool that really is slower costs
little; an outcome faster than the estimate by more than `clip` resets it and has the pool
re-sampled again as soon as that outcome is in, until its estimate is rebased.

Requests carrying a hint teach a per-(pool, hint) factor: the hint's observed rate relative to
the pool's estimate at the same bucket (a mean shrunk toward 1 by `hint_prior` samples, then
remembering `1/hint_alpha`), applied to its predictions once trusted. Hints live in
`max_hints` slots: a new hint takes a free slot, or the slot of the hint seen longest ago if
that one has not been seen in the last `hint_idle` hinted outcomes; otherwise it is not
tracked. Requests a client forced to a pool (`x-specroute-mode`) teach nothing: only the
policy's own decisions do, so a client cannot steer it or fill its hint slots.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import deque
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from policies.base import Decision, LoadView, Outcome, Pool, RequestInfo
from policies.calibration import HintSlots, ShrunkMean, check_bounds
from policies.profile import ProfileError, SpeedModel
from policies.routing import fallback, first_least_loaded, pool_decision, teaches
from policies.spec import PolicyContext, PolicySpec

_POOLS: tuple[Pool, Pool] = ("baseline", "eagle")
_MIN_CV2 = 0.05**2
"""Relative spread assumed at least (squared) for per-request rates: a real server is never
perfectly steady, so two near-equal pools keep being compared."""
RECENT = 8
"""Latest samples an estimate keeps: when most of them lie beyond `clip` of the estimate on one
side, it is rebased to their median (five outcomes of a new speed suffice; four outliers never
do)."""
WAIT_FLOOR_S = 0.05
"""Added to a TTFT wait before it is clipped by a factor: a wait of 0 is not 0 times anything."""
MAX_BACKOFF = 8
"""The re-sampling span of a pool that keeps confirming its estimate grows to this multiple."""
_PREFILL_PRIOR_WEIGHT = 2.0
"""Samples' worth of weight the prefill rate's prior has against its first samples."""


class OnlineParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    objective: Literal["e2e", "ttft"] = Field(
        default="e2e", description="What to minimise: end-to-end time (e2e) or time to first token (ttft)."
    )
    default_output_tokens: int = Field(
        default=256, ge=1, description="Output tokens assumed for a request that sets no max_tokens."
    )
    alpha: float = Field(
        default=0.02,
        gt=0.0,
        le=1.0,
        description="Weight of a new sample in a bucket's moving mean once 1/alpha samples are in.",
    )
    min_samples: int = Field(default=5, ge=1, description="Samples a bucket needs before it is trusted.")
    epsilon: float = Field(
        default=0.05,
        ge=0.0,
        le=1.0,
        description="Probability of sending a request to the other pool when the choice is uncertain.",
    )
    explore_z: float = Field(
        default=2.0,
        ge=0.0,
        description="The choice is uncertain while the two predictions are within this many standard errors.",
    )
    stale_half_life: int = Field(
        default=200,
        ge=1,
        description="Decisions after which an unsampled bucket's weight halves (a stale pool is re-checked).",
    )
    buckets: list[int] = Field(
        default=[1, 2, 4, 8, 16, 32, 48, 64, 128, 256],
        min_length=1,
        description="Upper bounds of the load buckets (requests on the backend including this one); "
        "one more bucket holds everything above the last bound.",
    )
    prior_decode_tok_s: float = Field(
        default=1000.0, gt=0.0, description="Optimistic decode rate of an untrusted bucket without a profile."
    )
    prior_ttft_s: float = Field(
        default=0.0, ge=0.0, description="Optimistic TTFT wait of an untrusted bucket without a profile."
    )
    prior_prefill_tok_s: float = Field(
        default=10000.0,
        gt=0.0,
        description="Prefill rate (prompt tokens/s) assumed until learned, without a profile that gives one.",
    )
    min_prefill_tokens: int = Field(
        default=512,
        ge=1,
        description="Uncached prompt tokens a request needs to teach the prefill rate (shorter: its TTFT "
        "is mostly wait).",
    )
    clip: float = Field(
        default=2.0,
        gt=1.0,
        description="A sample of a trusted estimate is clipped to within this factor of it; when 5 of its "
        "latest 8 samples lie beyond it on one side, the estimate is rebased to their median.",
    )
    resample_s: float = Field(
        default=10.0,
        ge=0.0,
        description="A pool not learned from for this long (and resample_every decisions) gets the next "
        "request; 0: never.",
    )
    resample_every: int = Field(
        default=20,
        ge=1,
        description="Decisions without an outcome of a pool before it may be re-sampled (see resample_s).",
    )
    max_hints: int = Field(
        default=16, ge=0, description="Distinct hints tracked (0 disables per-hint factors)."
    )
    hint_alpha: float = Field(
        default=0.005, gt=0.0, le=1.0, description="Weight of a new sample in a hint factor once settled."
    )
    hint_prior: float = Field(
        default=5.0,
        ge=0.0,
        description="Weight (in samples) of the neutral factor 1 against a hint's first samples.",
    )
    hint_idle: int = Field(
        default=1000,
        ge=1,
        description="A new hint may take the slot of a hint not seen in this many hinted outcomes.",
    )

    _buckets = field_validator("buckets")(check_bounds)


def _clipped(x: float, value: float, clip: float, floor: float) -> float:
    """`x` within a factor `clip` of `value` (both shifted by `floor`)."""
    low = (value + floor) / clip - floor
    high = (value + floor) * clip - floor
    return low if x < low else high if x > high else x


def _rebase(recent: deque[float], value: float, clip: float, floor: float) -> float | None:
    """When most of the latest `RECENT` samples lie beyond a factor `clip` of `value` on the same
    side, their median (what the estimate is rebased to); else None."""
    if len(recent) < RECENT:
        return None
    low = (value + floor) / clip - floor
    high = (value + floor) * clip - floor
    for side in ([x for x in recent if x > high], [x for x in recent if x < low]):
        if len(side) > RECENT // 2:
            side.sort()
            return side[len(side) // 2]
    return None


class _Robust:
    """A moving mean whose samples are clipped once it is trusted (see the module): a plain mean
    shrunk toward its prior by `prior_weight` samples, then an EWMA over `window` samples."""

    __slots__ = ("n", "recent", "value")

    def __init__(self, prior: float = 0.0) -> None:
        self.n = 0
        self.value = prior
        self.recent: deque[float] = deque(maxlen=RECENT)

    def add(
        self, x: float, prior_weight: float, window: float, clip: float, floor: float, trust: int
    ) -> None:
        self.recent.append(x)
        if self.n >= trust:
            median = _rebase(self.recent, self.value, clip, floor)
            if median is not None:
                self.n += 1
                self.value = median
                return
            x = _clipped(x, self.value, clip, floor)
        self.n += 1
        w = 1.0 / (self.n + prior_weight)
        least = 1.0 / window
        self.value += (w if w > least else least) * (x - self.value)


class _Rate:
    """Moving mean and spread of a bucket's decode rate, with an effective sample count that
    decays while the bucket goes unsampled; samples clipped and the mean rebased as `_Robust`'s."""

    __slots__ = ("last", "n", "recent", "square", "value", "weight")

    def __init__(self) -> None:
        self.n = 0
        """Samples ever taken (what trust is counted in)."""
        self.weight = 0.0
        """Effective samples: at most the memory, decayed by staleness."""
        self.value = 0.0
        self.square = 0.0
        """Moving mean of the squared rate."""
        self.last = 0
        """Decision count at the latest sample."""
        self.recent: deque[float] = deque(maxlen=RECENT)

    def add(self, x: float, window: float, keep: float, clip: float, trust: int) -> None:
        """One sample; `keep` is the fraction of the weight kept since the previous one."""
        self.recent.append(x)
        if self.n >= trust:
            median = _rebase(self.recent, self.value, clip, 0.0)
            if median is not None:
                self.n += 1
                self.value = median
                self.square = median * median * (1.0 + _MIN_CV2)
                return
            x = _clipped(x, self.value, clip, 0.0)
        self.n += 1
        weight = self.weight * keep
        self.weight = (weight if weight < window else window) + 1.0
        w = 1.0 / self.weight
        self.value += w * (x - self.value)
        self.square += w * (x * x - self.square)


class _Bucket:
    __slots__ = ("rate", "wait")

    def __init__(self) -> None:
        self.rate = _Rate()
        self.wait = _Robust()


class OnlinePolicy:
    name = "online"
    reads_features = False

    def __init__(self, params: OnlineParams, context: PolicyContext) -> None:
        self.params = params
        self._rng = random.Random(context.seed)
        self._speed: dict[Pool, SpeedModel | None] = {}
        for pool in _POOLS:
            try:
                self._speed[pool] = context.profile.belief(pool) if context.profile is not None else None
            except ProfileError:
                self._speed[pool] = None
        self._bounds = list(params.buckets)
        # bucket index per batch size up to the last bound, for a list lookup on the hot path
        self._bucket_of = [bisect_left(self._bounds, b) for b in range(self._bounds[-1] + 1)]
        self._stats: dict[Pool, list[_Bucket]] = {
            pool: [_Bucket() for _ in range(len(self._bounds) + 1)] for pool in _POOLS
        }
        self._prefill: dict[Pool, _Robust] = {}
        """Seconds per uncached prompt token, per pool (its prior: the profile's prefill rate)."""
        for pool in _POOLS:
            speed = self._speed[pool]
            tok_s = (
                speed.prefill_tok_s
                if speed is not None and speed.prefill_tok_s
                else params.prior_prefill_tok_s
            )
            self._prefill[pool] = _Robust(1.0 / tok_s)
        self._hints: HintSlots[dict[Pool, ShrunkMean]] = HintSlots(
            params.max_hints,
            params.hint_idle,
            lambda _: {"baseline": ShrunkMean(1.0), "eagle": ShrunkMean(1.0)},
        )
        self._ttft_objective = params.objective == "ttft"
        self._min_samples = params.min_samples
        self._window = 1.0 / params.alpha
        self._decisions = 0
        self._decay = math.log(2.0) / params.stale_half_life
        self._heard: dict[Pool, tuple[float, int]] = {}
        """Per pool, when (`now`, decision count) it was last taught or re-sampled."""
        self._surprised: set[Pool] = set()
        """Pools whose latest outcome was faster than their estimate by more than `clip`."""
        self._probing: set[Pool] = set()
        """Pools with a re-sampling request whose outcome has not come back yet."""
        self._backoff: dict[Pool, int] = {"baseline": 1, "eagle": 1}
        """Per pool, the re-sampling span's multiple: doubled (up to `MAX_BACKOFF`) by each
        re-sample that confirms the estimate, back to 1 on an outcome that does not."""

    def reset(self) -> None:
        """A new segment (rule 7): forget when each pool was last heard of (its clock starts anew)."""
        self._heard.clear()
        self._probing.clear()
        self._backoff = {"baseline": 1, "eagle": 1}

    def _bucket(self, pool: Pool, batch: int) -> _Bucket:
        table = self._bucket_of
        return self._stats[pool][table[batch] if batch < len(table) else len(self._bounds)]

    def _profile_rate(self, pool: Pool, batch: int) -> float | None:
        speed = self._speed[pool]
        if speed is None:
            return None
        cap = speed.max_running_requests
        return speed.decode_tok_s(batch if cap is None or batch <= cap else cap)

    def _prior(self, pool: Pool, load: int, n: int) -> tuple[float, float]:
        """(TTFT wait, decode seconds) for an untrusted bucket: the profile's, or the optimistic prior."""
        p = self.params
        speed = self._speed[pool]
        if speed is None:
            return p.prior_ttft_s, (n - 1) / p.prior_decode_tok_s
        prof_ttft, prof_e2e = speed.predict_e2e_s(
            n, load, 0, mean_output_tokens=float(p.default_output_tokens)
        )
        return prof_ttft, prof_e2e - prof_ttft

    def _keep(self, rate: _Rate) -> float:
        """The fraction of a bucket's weight left after the decisions since its latest sample."""
        age = self._decisions - rate.last
        return math.exp(-self._decay * age) if age > 0 else 1.0

    def _hint_factor(self, pool: Pool, hint: str | None) -> float:
        if hint is None:
            return 1.0
        factors = self._hints.get(hint)
        if factors is None:
            return 1.0
        factor = factors[pool]
        return factor.value if factor.n >= self._min_samples else 1.0

    def _predict(
        self, pool: Pool, load: int, n: int, request: RequestInfo, prompt: int
    ) -> tuple[float, float, _Bucket]:
        """(TTFT, end-to-end, the bucket) for a request joining a backend at `load` with `prompt`
        uncached prompt tokens."""
        bucket = self._bucket(pool, load + 1)
        min_samples = self._min_samples
        wait_mean, rate_mean = bucket.wait, bucket.rate
        if wait_mean.n >= min_samples and rate_mean.n >= min_samples:
            wait, rate = wait_mean.value, rate_mean.value
        else:
            prof_wait, prof_decode = self._prior(pool, load, n)
            wait = wait_mean.value if wait_mean.n >= min_samples else prof_wait
            if rate_mean.n >= min_samples:
                rate = rate_mean.value
            else:
                rate = (n - 1) / prof_decode if prof_decode > 0 else self.params.prior_decode_tok_s
        if request.hint is not None:
            rate *= self._hint_factor(pool, request.hint)
        ttft = wait + self._prefill[pool].value * prompt
        return ttft, ttft + (n - 1) / rate, bucket

    def _uncertain(self, ce: float, cb: float, e: _Bucket, b: _Bucket) -> bool:
        """Whether the choice between the two predictions is uncertain (see the module)."""
        variance = 0.0
        for rate in (e.rate, b.rate):
            w = rate.weight * self._keep(rate)
            if rate.n < self._min_samples or w < 1.0:
                return True
            mean = rate.value
            cv2 = (rate.square - mean * mean) / (mean * mean)
            variance += (cv2 if cv2 > _MIN_CV2 else _MIN_CV2) / w
        return abs(ce - cb) <= self.params.explore_z * math.sqrt(variance) * min(ce, cb)

    def _resample(self, pool: Pool, now: float) -> bool:
        """Whether the next request re-samples `pool`: it has gone unheard of for `resample_s`
        seconds and `resample_every` decisions, or its latest outcome was faster than its estimate
        by more than `clip` and no re-sampling request of it is out (so a pool that turned fast
        again is re-sampled outcome after outcome until its estimate is rebased)."""
        p = self.params
        if p.resample_s <= 0:
            return False
        heard = self._heard.setdefault(pool, (now, self._decisions))
        span = self._backoff[pool]
        due = now - heard[0] >= p.resample_s * span and self._decisions - heard[1] >= p.resample_every * span
        if not due and (pool not in self._surprised or pool in self._probing):
            return False
        self._heard[pool] = (now, self._decisions)
        self._probing.add(pool)
        self._surprised.discard(pool)
        return True

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        self._decisions += 1
        n = request.max_tokens or self.params.default_output_tokens
        if n < 1:
            n = 1
        ttft: dict[Pool, float] = {}
        e2e: dict[Pool, float] = {}
        buckets: dict[Pool, _Bucket] = {}
        for pool in _POOLS:
            backend = first_least_loaded(view.pool(pool))
            if backend is not None:
                prompt = request.prompt_tokens - backend.cached_tokens
                ttft[pool], e2e[pool], buckets[pool] = self._predict(
                    pool, backend.load, n, request, prompt if prompt > 0 else 0
                )
        if len(e2e) < 2:  # the routing core's fallback (rule 4)
            pool, reason = fallback(e2e)
        else:
            cost = ttft if self._ttft_objective else e2e
            ce, cb = cost["eagle"], cost["baseline"]
            e, b = buckets["eagle"], buckets["baseline"]
            if ce < cb or (ce == cb and e.rate.n < b.rate.n):
                pool, reason = "eagle", "faster_eagle"
            else:
                pool, reason = "baseline", "faster_baseline"
            other: Pool = "baseline" if pool == "eagle" else "eagle"
            eps = self.params.epsilon
            if self._resample(other, now) or (
                eps > 0.0 and self._uncertain(ce, cb, e, b) and self._rng.random() < eps
            ):
                pool, reason = other, "explore"
        return pool_decision(pool, reason, policy=self.name, predicted_ttft_s=ttft, predicted_e2e_s=e2e)

    def observe(self, outcome: Outcome) -> None:
        pool = outcome.decision.pool
        probed = pool in self._probing
        self._probing.discard(pool)
        if not teaches(outcome):
            return  # only requests this policy routed to where they ran teach it
        surprise = self._learn(outcome)
        if surprise:
            self._surprised.add(pool)
            self._backoff[pool] = 1
        else:
            self._surprised.discard(pool)
            if probed:
                self._backoff[pool] = min(2 * self._backoff[pool], MAX_BACKOFF)

    def _learn(self, outcome: Outcome) -> bool:
        """Learn from an outcome that teaches; whether it was faster than the estimates by more
        than `clip` (a surprise)."""
        decision = outcome.decision
        pool = decision.pool
        surprise = False
        p = self.params
        heard = self._heard.get(pool)
        if heard is None or outcome.started_at >= heard[0]:
            self._heard[pool] = (outcome.started_at, self._decisions)
        batch = decision.backend_load + outcome.request.sequences  # this request ran in the batch too
        bucket = self._bucket(pool, batch)
        window = self._window
        trust = self._min_samples
        if outcome.ttft_s is not None:
            prompt = outcome.request.prompt_tokens - (outcome.cached_tokens or 0)
            prefill = self._prefill[pool]
            if prompt >= p.min_prefill_tokens:
                wait = (
                    bucket.wait.value
                    if bucket.wait.n >= trust
                    else self._prior(pool, decision.backend_load, 1)[0]
                )
                x = outcome.ttft_s - wait
                prefill.add((x if x > 0 else 0.0) / prompt, _PREFILL_PRIOR_WEIGHT, window, p.clip, 0.0, trust)
            x = outcome.ttft_s - prefill.value * (prompt if prompt > 0 else 0)
            wait = x if x > 0 else 0.0
            surprise = bucket.wait.n >= trust and wait < _clipped(
                wait, bucket.wait.value, p.clip, WAIT_FLOOR_S
            )
            bucket.wait.add(wait, 0.0, window, p.clip, WAIT_FLOOR_S, trust)
        rate = outcome.decode_tok_s
        if rate is None:
            return surprise
        hint = outcome.request.hint
        factor = 1.0
        if hint is not None and p.max_hints > 0:
            # reference: the pool's estimate for this bucket before this sample
            ref = bucket.rate.value if bucket.rate.n >= p.min_samples else self._profile_rate(pool, batch)
            if ref is not None and ref > 0:
                factors = self._hints.teach(hint)
                if factors is not None:
                    factors[pool].add(rate / ref, p.hint_prior, 1.0 / p.hint_alpha)
                    factor = self._hint_factor(pool, hint)
        # the bucket learns the rate of untagged traffic; a stale one forgets faster
        untagged = rate / factor
        if bucket.rate.n >= trust and untagged > _clipped(untagged, bucket.rate.value, p.clip, 0.0):
            surprise = True
        bucket.rate.add(untagged, window, self._keep(bucket.rate), p.clip, trust)
        bucket.rate.last = self._decisions
        return surprise

    def state(self) -> dict[str, Any]:
        """What the policy has learned, as plain data (for inspection and tests)."""
        bounds: list[int | None] = [*self._bounds, None]
        return {
            "buckets": {
                pool: [
                    {
                        "max_batch": bound,
                        "rate_samples": b.rate.n,
                        "decode_tok_s": b.rate.value if b.rate.n else None,
                        "wait_samples": b.wait.n,
                        "wait_s": b.wait.value if b.wait.n else None,
                    }
                    for bound, b in zip(bounds, self._stats[pool], strict=True)
                ]
                for pool in _POOLS
            },
            "prefill_tok_s": {
                pool: 1.0 / m.value if m.value > 0 else None for pool, m in self._prefill.items()
            },
            "prefill_samples": {pool: m.n for pool, m in self._prefill.items()},
            "hint_factors": {
                f"{pool}:{hint}": {"samples": m[pool].n, "factor": m[pool].value}
                for hint, m in self._hints.items()
                for pool in _POOLS
                if m[pool].n
            },
        }


SPEC = PolicySpec(
    name="online",
    params=OnlineParams,
    factory=OnlinePolicy,
    help="Learn each pool's decode rate and TTFT wait per load bucket and its prefill rate per prompt "
    "token from finished requests, robustly (clipped, rebased on a persistent change); profile or "
    "optimistic prior until trusted; explore near the decision boundary and re-sample a pool unheard of.",
)
