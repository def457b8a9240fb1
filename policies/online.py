"""`online`: learn each pool's speed under load from the requests it routes.

How it works: every finished request this policy routed is filed under its pool and its load
bucket (the load of the chosen backend when it was chosen, plus the request itself). Per
bucket the policy keeps moving means (`policies.calibration.ShrunkMean`: a plain mean of the
first samples, then an exponentially weighted one remembering `1/alpha` samples) of the
observed decode rate (`Outcome.decode_tok_s`, divided by the request's hint factor), its
spread, and TTFT (which includes any queue wait, so queueing past `max_running_requests` is
learned too).

To decide, each pool's estimate at its least-loaded backend's bucket predicts this request's
end-to-end time (or TTFT); the smaller wins. A bucket is trusted once it holds `min_samples`
samples; before that the speed profile answers (if one is given), or an optimistic prior that
makes unexplored buckets attractive so they get explored.

Exploration happens only near the decision boundary and fades with confidence: a request is
sent to the other pool (with probability `epsilon`, seeded RNG) only when the two predictions
are within `explore_z` standard errors of each other (the errors shrink as the buckets fill),
or when one of the two buckets is not confident -- untrusted, or not sampled for so long that
its weight (in samples; it halves every `stale_half_life` decisions) is below one sample. So a
clear choice stops exploring, and a pool that has gone unused is re-checked now and then (after
a few hundred decisions), which is how a recovery (say, of EAGLE acceptance) is noticed.

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
        default=0.0, ge=0.0, description="Optimistic TTFT of an untrusted bucket without a profile."
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


class _Rate:
    """Moving mean and spread of a bucket's decode rate, with an effective sample count that
    decays while the bucket goes unsampled."""

    __slots__ = ("last", "n", "square", "value", "weight")

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

    def add(self, x: float, window: float, keep: float) -> None:
        """One sample; `keep` is the fraction of the weight kept since the previous one."""
        self.n += 1
        weight = self.weight * keep
        self.weight = (weight if weight < window else window) + 1.0
        w = 1.0 / self.weight
        self.value += w * (x - self.value)
        self.square += w * (x * x - self.square)


class _Bucket:
    __slots__ = ("rate", "ttft")

    def __init__(self) -> None:
        self.rate = _Rate()
        self.ttft = ShrunkMean()


class OnlinePolicy:
    name = "online"
    reads_features = False

    def __init__(self, params: OnlineParams, context: PolicyContext) -> None:
        self.params = params
        self._rng = random.Random(context.seed)
        self._speed: dict[Pool, SpeedModel | None] = {}
        for pool in _POOLS:
            try:
                self._speed[pool] = context.profile.speed(pool) if context.profile is not None else None
            except ProfileError:
                self._speed[pool] = None
        self._bounds = list(params.buckets)
        # bucket index per batch size up to the last bound, for a list lookup on the hot path
        self._bucket_of = [bisect_left(self._bounds, b) for b in range(self._bounds[-1] + 1)]
        self._stats: dict[Pool, list[_Bucket]] = {
            pool: [_Bucket() for _ in range(len(self._bounds) + 1)] for pool in _POOLS
        }
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

    def _bucket(self, pool: Pool, batch: int) -> _Bucket:
        table = self._bucket_of
        return self._stats[pool][table[batch] if batch < len(table) else len(self._bounds)]

    def _profile_rate(self, pool: Pool, batch: int) -> float | None:
        speed = self._speed[pool]
        if speed is None:
            return None
        cap = speed.max_running_requests
        return speed.decode_tok_s(batch if cap is None or batch <= cap else cap)

    def _prior(self, pool: Pool, load: int, n: int, request: RequestInfo) -> tuple[float, float]:
        """(TTFT, decode seconds) for an untrusted bucket: the profile's, or the optimistic prior."""
        p = self.params
        speed = self._speed[pool]
        if speed is None:
            return p.prior_ttft_s, (n - 1) / p.prior_decode_tok_s
        prof_ttft, prof_e2e = speed.predict_e2e_s(
            n,
            load,
            0,
            mean_output_tokens=float(p.default_output_tokens),
            prompt_tokens=request.prompt_tokens,
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

    def _predict(self, pool: Pool, load: int, n: int, request: RequestInfo) -> tuple[float, float, _Bucket]:
        """(TTFT, end-to-end, the bucket) for a request joining a backend at `load`."""
        bucket = self._bucket(pool, load + 1)
        min_samples = self._min_samples
        ttft_mean, rate_mean = bucket.ttft, bucket.rate
        if ttft_mean.n >= min_samples and rate_mean.n >= min_samples:
            ttft, rate = ttft_mean.value, rate_mean.value
        else:
            prof_ttft, prof_decode = self._prior(pool, load, n, request)
            ttft = ttft_mean.value if ttft_mean.n >= min_samples else prof_ttft
            if rate_mean.n >= min_samples:
                rate = rate_mean.value
            else:
                rate = (n - 1) / prof_decode if prof_decode > 0 else self.params.prior_decode_tok_s
        if request.hint is not None:
            rate *= self._hint_factor(pool, request.hint)
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
                ttft[pool], e2e[pool], buckets[pool] = self._predict(pool, backend.load, n, request)
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
            eps = self.params.epsilon
            if eps > 0.0 and self._uncertain(ce, cb, e, b) and self._rng.random() < eps:
                pool, reason = ("baseline" if pool == "eagle" else "eagle"), "explore"
        return pool_decision(pool, reason, policy=self.name, predicted_ttft_s=ttft, predicted_e2e_s=e2e)

    def observe(self, outcome: Outcome) -> None:
        if not teaches(outcome):
            return  # only requests this policy routed to where they ran teach it
        decision = outcome.decision
        p = self.params
        pool = decision.pool
        batch = decision.backend_load + 1
        bucket = self._bucket(pool, batch)
        window = self._window
        if outcome.ttft_s is not None:
            bucket.ttft.add(outcome.ttft_s, 0.0, window)
        rate = outcome.decode_tok_s
        if rate is None:
            return
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
        bucket.rate.add(rate / factor, window, self._keep(bucket.rate))
        bucket.rate.last = self._decisions

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
                        "ttft_samples": b.ttft.n,
                        "ttft_s": b.ttft.value if b.ttft.n else None,
                    }
                    for bound, b in zip(bounds, self._stats[pool], strict=True)
                ]
                for pool in _POOLS
            },
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
    help="Learn each pool's decode rate and TTFT per load bucket from finished requests "
    "(profile or optimistic prior until trusted); explore only near the decision boundary.",
)
