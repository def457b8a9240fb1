"""Statistics across seeds for `specroute plan`: means with 95% t-intervals, paired margins, ties.

Every deployment is evaluated on the same list of seeds, and a seed fixes the workload (the same
requests, lengths, arrivals and acceptance draws for every deployment). The margin between two
deployments is therefore computed on the per-seed differences (a paired comparison), which
removes the workload's own variation from the interval. A margin whose 95% interval contains
zero is a tie: the simulation cannot tell the two apart on these seeds. So is a margin smaller
than a given fraction of the better value (`tie_within`): the simulator's speed model is not
exact to a fraction of a percent, so such a difference decides nothing even when the seeds
agree on it (deterministic workloads give zero-width intervals).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# Two-sided 95% quantiles of Student's t, by degrees of freedom (1..30), then a few anchors.
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_T95_TAIL = ((40, 2.021), (60, 2.000), (120, 1.980))
_REL_TOL = 1e-9
"""Differences smaller than this (relative to the values) are floating-point noise: a tie."""

Verdict = Literal["win", "tie", "n/a"]


def t95(df: int) -> float:
    """Two-sided 95% quantile of Student's t with `df` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError("degrees of freedom must be >= 1")
    if df <= len(_T95):
        return _T95[df - 1]
    for limit, value in _T95_TAIL:
        if df <= limit:
            return value
    return 1.960


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
    verdict: Verdict

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
    if abs(iv.mean) <= _REL_TOL * scale and (math.isnan(iv.half) or iv.half <= _REL_TOL * scale):
        return Margin(iv, "tie")  # identical up to rounding, whatever the seed count
    if abs(iv.mean) <= tie_within * abs(math.fsum(better) / len(better)):
        return Margin(iv, "tie")
    if math.isnan(iv.half):
        return Margin(iv, "n/a")  # one seed: no estimate of the noise
    return Margin(iv, "tie" if iv.low <= 0.0 <= iv.high else "win")
