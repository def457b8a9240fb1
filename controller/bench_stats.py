"""Statistics for `specroute bench`: mean with a Student-t confidence interval, percentiles,
and the overlap test `compare` uses for its verdicts.

How it works: the two-sided t quantile is found by bisection on the exact CDF of Student's
t for integer degrees of freedom, which has a closed form as a finite trigonometric series
(Abramowitz & Stegun 26.7.3-4). Beyond 1000 degrees of freedom the normal quantile is used
(the difference is below 1e-3). No scipy needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

_NORMAL_ABOVE_DF = 1000


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
