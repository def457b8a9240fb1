"""`online`: learn each pool's speed under load from the requests it routes.

How it works: every finished request is filed under its pool and its load bucket (the load
of the chosen backend when it was chosen, plus the request itself). Per bucket the policy
keeps an exponentially weighted mean of the observed decode rate (`Outcome.decode_tok_s`) and
TTFT (which includes any queue wait, so queueing past `max_running_requests` is learned too).
The first samples are averaged plainly; after `1/alpha` samples each new one weighs `alpha`.

To decide, each pool's estimate at its least-loaded backend's bucket predicts this request's
end-to-end time (or TTFT); the smaller wins. A bucket is trusted once it holds `min_samples`
samples; before that the speed profile answers (if one is given), or an optimistic prior
that makes unexplored buckets attractive so they get explored. A fraction `epsilon` of the
requests goes to the other pool (seeded RNG) so a change in acceptance (code vs prose) is
noticed. Requests carrying a hint also teach a per-(pool, hint) factor: the hint's observed
rate relative to the pool's estimate at the same bucket, applied once trusted.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from itertools import pairwise
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from policies.base import Decision, LoadView, NoHealthyBackend, Outcome, Pool, RequestInfo
from policies.profile import ProfileError, SpeedModel
from policies.routing import first_least_loaded, route
from policies.spec import PolicyContext, PolicySpec

_POOLS: tuple[Pool, Pool] = ("baseline", "eagle")


class OnlineParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    objective: Literal["e2e", "ttft"] = Field(
        default="e2e", description="What to minimise: end-to-end time (e2e) or time to first token (ttft)."
    )
    default_output_tokens: int = Field(
        default=256, ge=1, description="Output tokens assumed for a request that sets no max_tokens."
    )
    alpha: float = Field(
        default=0.1, gt=0.0, le=1.0, description="Weight of a new sample in the moving mean."
    )
    min_samples: int = Field(default=5, ge=1, description="Samples a bucket needs before it is trusted.")
    epsilon: float = Field(
        default=0.05,
        ge=0.0,
        le=1.0,
        description="Fraction of requests sent to the other pool to keep learning.",
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

    @field_validator("buckets")
    @classmethod
    def _increasing(cls, v: list[int]) -> list[int]:
        if v[0] < 1 or any(b <= a for a, b in pairwise(v)):
            raise ValueError("must be positive and strictly increasing")
        return v


class _Mean:
    """Moving mean: a plain mean over the first 1/alpha samples, then EWMA with `alpha`."""

    __slots__ = ("n", "value")

    def __init__(self) -> None:
        self.n = 0
        self.value = 0.0

    def add(self, x: float, alpha: float) -> None:
        self.n += 1
        w = 1.0 / self.n
        self.value += (w if w > alpha else alpha) * (x - self.value)


class _Bucket:
    __slots__ = ("rate", "ttft")

    def __init__(self) -> None:
        self.rate = _Mean()
        self.ttft = _Mean()


class OnlinePolicy:
    name = "online"

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
        self._hint_factor: dict[tuple[Pool, str], _Mean] = {}
        self._hints: set[str] = set()
        self._ttft_objective = params.objective == "ttft"
        self._min_samples = params.min_samples

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

    def _predict(self, pool: Pool, load: int, n: int, request: RequestInfo) -> tuple[float, float, int]:
        """(TTFT, end-to-end, samples in the bucket) for a request joining a backend at `load`."""
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
            factor = self._hint_factor.get((pool, request.hint))
            if factor is not None and factor.n >= min_samples:
                rate *= factor.value
        return ttft, ttft + (n - 1) / rate, rate_mean.n

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        n = request.max_tokens or self.params.default_output_tokens
        if n < 1:
            n = 1
        ttft: dict[Pool, float] = {}
        e2e: dict[Pool, float] = {}
        seen: dict[Pool, int] = {}
        for pool in _POOLS:
            backend = first_least_loaded(view.pool(pool))
            if backend is not None:
                ttft[pool], e2e[pool], seen[pool] = self._predict(pool, backend.load, n, request)
        if request.forced_pool is not None:
            pool, reason = request.forced_pool, "client_override"
        elif len(e2e) < 2:
            if not e2e:
                raise NoHealthyBackend("no healthy backend in either pool")
            pool = "eagle" if "eagle" in e2e else "baseline"
            reason = f"{'baseline' if pool == 'eagle' else 'eagle'}_unavailable"
        else:
            cost = ttft if self._ttft_objective else e2e
            ce, cb = cost["eagle"], cost["baseline"]
            if ce < cb or (ce == cb and seen["eagle"] < seen["baseline"]):
                pool, reason = "eagle", "faster_eagle"
            else:
                pool, reason = "baseline", "faster_baseline"
            eps = self.params.epsilon
            if eps > 0.0 and self._rng.random() < eps:
                pool, reason = ("baseline" if pool == "eagle" else "eagle"), "explore"
        return route(
            view, pool, reason, self._rng, policy=self.name, predicted_ttft_s=ttft, predicted_e2e_s=e2e
        )

    def observe(self, outcome: Outcome) -> None:
        if outcome.status != "ok":
            return
        p = self.params
        pool = outcome.decision.pool
        batch = outcome.decision.backend_load + 1
        bucket = self._bucket(pool, batch)
        if outcome.ttft_s is not None:
            bucket.ttft.add(outcome.ttft_s, p.alpha)
        rate = outcome.decode_tok_s
        if rate is None:
            return
        hint = outcome.request.hint
        if hint is not None and p.max_hints > 0:
            # reference: what the pool's estimate was for this bucket before this sample
            ref = bucket.rate.value if bucket.rate.n >= p.min_samples else self._profile_rate(pool, batch)
            if ref is not None and (hint in self._hints or len(self._hints) < p.max_hints):
                self._hints.add(hint)
                factor = self._hint_factor.get((pool, hint))
                if factor is None:
                    factor = self._hint_factor[(pool, hint)] = _Mean()
                factor.add(rate / ref, p.alpha)
        bucket.rate.add(rate, p.alpha)

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
                f"{pool}:{hint}": {"samples": m.n, "factor": m.value}
                for (pool, hint), m in sorted(self._hint_factor.items())
            },
        }


SPEC = PolicySpec(
    name="online",
    params=OnlineParams,
    factory=OnlinePolicy,
    help="Learn each pool's decode rate and TTFT per load bucket from finished requests "
    "(profile or optimistic prior until trusted); explore a fraction epsilon.",
)
