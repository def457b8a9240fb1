"""The one statistics module: Student-t quantiles, means with confidence intervals,
percentiles, the overlap verdict `bench`/`compare` print, the paired margins across seeds `plan`
and `tune` rank with, and the unpaired (Welch) differences `demo` judges with; one tie rule for
both kinds of difference (`tie_rule`).

How it works: the two-sided t quantile is found by bisection on the exact CDF of Student's
t for integer degrees of freedom, which has a closed form as a finite trigonometric series
(Abramowitz & Stegun 26.7.3-4). Beyond 1000 degrees of freedom the normal quantile is used
(the difference is below 1e-3). No scipy needed.

Paired margins (`plan`): every deployment is evaluated on the same list of seeds, and a seed
fixes the workload (the same requests, lengths, arrivals and acceptance draws for every
deployment). The margin between two deployments is therefore computed on the per-seed
differences (a paired comparison), which removes the workload's own variation from the
interval. A margin whose 95% interval contains zero is a tie: the simulation cannot tell the two
apart on these seeds. So is a margin smaller than a given fraction of the better value
(`tie_within`): the simulator's speed model is not exact to a fraction of a percent, so such a
difference decides nothing even when the seeds agree on it (deterministic workloads give
zero-width intervals).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Literal

_NORMAL_ABOVE_DF = 1000
_REL_TOL = 1e-9
"""Differences smaller than this (relative to the values) are floating-point noise: a tie."""


def _t_two_sided_mass(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with `df` degrees of freedom (A&S 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    c2 = c * c
    if df % 2 == 1:
        if df == 1:
            return 2.0 * theta / math.pi
        term, total = c, c
        for k in range(3, df - 1, 2):  # c + (2/3)c^3 + (2*4)/(3*5)c^5 + ...
            term *= c2 * (k - 1) / k
            total += term
        return 2.0 / math.pi * (theta + s * total)
    term, total = 1.0, 1.0
    for k in range(2, df - 1, 2):  # 1 + (1/2)c^2 + (1*3)/(2*4)c^4 + ...
        term *= c2 * (k - 1) / k
        total += term
    return s * total


def t_quantile(confidence: float, df: int) -> float:
    """The t value with `confidence` probability mass between -t and t (e.g. 0.95)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df > _NORMAL_ABOVE_DF:
        return NormalDist().inv_cdf(0.5 + confidence / 2.0)
    lo, hi = 0.0, 1.0
    while _t_two_sided_mass(hi, df) < confidence:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        if _t_two_sided_mass(mid, df) < confidence:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return (lo + hi) / 2.0


def t95(df: int) -> float:
    """Two-sided 95% quantile of Student's t with `df` degrees of freedom (df >= 1)."""
    return t_quantile(0.95, df)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(xs) - 1)
    return xs[low] + (xs[high] - xs[low]) * (pos - low)


@dataclass(frozen=True)
class Estimate:
    """A mean with its confidence interval; `half_width` is None below two samples."""

    n: int
    mean: float
    half_width: float | None
    std: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @property
    def low(self) -> float:
        return self.mean - (self.half_width or 0.0)

    @property
    def high(self) -> float:
        return self.mean + (self.half_width or 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "mean": self.mean,
            "ci95": self.half_width,
            "std": self.std,
            "p50": self.p50,
            "p90": self.p90,
            "p99": self.p99,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Estimate:
        return cls(
            n=int(data["n"]),
            mean=float(data["mean"]),
            half_width=_opt_float(data.get("ci95")),
            std=_opt_float(data.get("std")),
            p50=_opt_float(data.get("p50")),
            p90=_opt_float(data.get("p90")),
            p99=_opt_float(data.get("p99")),
        )


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def estimate(values: Sequence[float], confidence: float = 0.95) -> Estimate | None:
    """Mean, t-interval half-width, standard deviation and p50/p90/p99; None for no values."""
    n = len(values)
    if n == 0:
        return None
    mean = math.fsum(values) / n
    std = half = None
    if n >= 2:
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
        half = t_quantile(confidence, n - 1) * std / math.sqrt(n)
    return Estimate(
        n=n,
        mean=mean,
        half_width=half,
        std=std,
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
    )


def ratio_relative_half_width(
    numerators: Sequence[float], denominators: Sequence[float], confidence: float = 0.95
) -> float | None:
    """Relative CI half-width of the ratio estimator sum(y)/sum(x) (delta method).

    Used for total throughput: in a closed loop with C requests always in flight the
    server's output rate is C * sum(tokens) / sum(e2e) (Little's law), so the per-request
    spread of tokens and durations gives the uncertainty of the measured figure.
    """
    n = len(numerators)
    if n != len(denominators):
        raise ValueError("numerators and denominators differ in length")
    if n < 2:
        return None
    sx = math.fsum(denominators)
    if sx <= 0:
        return None
    ratio = math.fsum(numerators) / sx
    if ratio <= 0:
        return None
    resid = [y - ratio * x for y, x in zip(numerators, denominators, strict=True)]
    var = math.fsum(r * r for r in resid) / (n - 1)
    mean_x = sx / n
    se = math.sqrt(var / n) / mean_x
    return t_quantile(confidence, n - 1) * se / ratio


Verdict = str  # "faster" | "slower" | "not distinguishable"


def verdict(base: Estimate | None, other: Estimate | None, higher_is_better: bool) -> Verdict:
    """Compare `other` against `base`: faster / slower, or not distinguishable when the
    confidence intervals overlap (or either has too few samples for an interval)."""
    if base is None or other is None or base.half_width is None or other.half_width is None:
        return "not distinguishable"
    if other.low <= base.high and base.low <= other.high:
        return "not distinguishable"
    better = other.mean > base.mean if higher_is_better else other.mean < base.mean
    return "faster" if better else "slower"


# --- paired margins across seeds (plan) ----------------------------------------------------

MarginVerdict = Literal["win", "tie", "n/a"]


@dataclass(frozen=True)
class Interval:
    """A mean over `n` seeds with its 95% t-interval (`half` is NaN with fewer than 2 seeds)."""

    mean: float
    half: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half

    def to_json(self) -> dict[str, float | int | None]:
        def clean(v: float) -> float | None:
            return None if math.isnan(v) else v

        return {
            "mean": clean(self.mean),
            "ci95_low": clean(self.low),
            "ci95_high": clean(self.high),
            "n": self.n,
        }


def interval(values: Sequence[float]) -> Interval:
    """Mean and 95% t-interval of `values` (NaN anywhere gives a NaN mean)."""
    n = len(values)
    if n == 0 or any(math.isnan(v) for v in values):
        return Interval(math.nan, math.nan, n)
    mean = math.fsum(values) / n
    if n < 2:
        return Interval(mean, math.nan, n)
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return Interval(mean, t95(n - 1) * math.sqrt(var) / math.sqrt(n), n)


@dataclass(frozen=True)
class Margin:
    """How much better `better` is than `worse`, per seed, as a paired 95% interval.

    Positive means `better` really is better in the objective's direction (lower latency or
    higher goodput).
    """

    diff: Interval
    verdict: MarginVerdict

    def to_json(self) -> dict[str, object]:
        return {**self.diff.to_json(), "verdict": self.verdict}


def paired_margin(
    better: Sequence[float], worse: Sequence[float], *, higher_is_better: bool, tie_within: float = 0.0
) -> Margin:
    """The paired margin of `better` over `worse` (same seeds, same order).

    `tie_within`: margins up to this fraction of `better`'s mean are ties too.
    """
    if len(better) != len(worse):
        raise ValueError("paired samples must have the same length")
    sign = 1.0 if higher_is_better else -1.0
    diffs = [sign * (b - w) for b, w in zip(better, worse, strict=True)]
    iv = interval(diffs)
    if math.isnan(iv.mean):
        return Margin(iv, "n/a")
    scale = max((abs(v) for v in [*better, *worse]), default=0.0)
    return Margin(iv, tie_rule(iv, math.fsum(better) / len(better), tie_within, scale))


def tie_rule(diff: Interval, reference: float, tie_within: float = 0.0, scale: float = 0.0) -> MarginVerdict:
    """The tie rule on a difference between two figures: "tie" when the difference is
    floating-point noise (relative to `scale`, the largest value compared), at most `tie_within`
    of `reference` (the figure it is a margin of), or when its 95% interval contains zero;
    "n/a" without an interval; else "win": the difference is resolved, whatever its sign."""
    if math.isnan(diff.mean):
        return "n/a"
    if abs(diff.mean) <= _REL_TOL * scale and (math.isnan(diff.half) or diff.half <= _REL_TOL * scale):
        return "tie"  # identical up to rounding, whatever the sample size
    if abs(diff.mean) <= tie_within * abs(reference):
        return "tie"
    if math.isnan(diff.half):
        return "n/a"  # one sample: no estimate of the noise
    return "tie" if diff.low <= 0.0 <= diff.high else "win"


def welch_difference(base: Estimate, other: Estimate, confidence: float = 0.95) -> Interval:
    """`other.mean - base.mean` of two independent samples with Welch's t-interval (unequal
    variances; Welch-Satterthwaite degrees of freedom, rounded down); `half` is NaN when either
    has fewer than two values. `n` is the smaller sample."""
    n = min(base.n, other.n)
    diff = other.mean - base.mean
    if base.std is None or other.std is None or base.n < 2 or other.n < 2:
        return Interval(diff, math.nan, n)
    va, vb = base.std**2 / base.n, other.std**2 / other.n
    se2 = va + vb
    if se2 == 0.0:
        return Interval(diff, 0.0, n)
    df = se2**2 / (va**2 / (base.n - 1) + vb**2 / (other.n - 1))
    return Interval(diff, t_quantile(confidence, max(1, math.floor(df))) * math.sqrt(se2), n)
