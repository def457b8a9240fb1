"""`threshold`: eagle while the eagle pool is lightly loaded, else baseline.

Hysteresis keeps traffic from flapping: once the eagle pool's load reaches `threshold` new
requests go to baseline, and they only return to eagle when the load has fallen below
`threshold - hysteresis`. The load signal is the proxy's own in-flight count (`local`), the
backend-reported running+queued requests (`scraped`), or the larger of the two (`max`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.base import Decision, LoadView, Outcome, PoolLoad, RequestInfo
from policies.routing import pool_decision
from policies.spec import PolicyContext, PolicySpec

Signal = Literal["local", "scraped", "max"]


class ThresholdParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    threshold: int = Field(default=8, ge=1, description="Eagle-pool load at which traffic moves to baseline.")
    hysteresis: int = Field(
        default=0, ge=0, description="Load must fall below threshold - hysteresis to move back to eagle."
    )
    signal: Signal = Field(
        default="max", description="Load signal: local in-flight, scraped running+queued, or max of both."
    )

    @model_validator(mode="after")
    def _band(self) -> ThresholdParams:
        if self.hysteresis >= self.threshold:
            raise ValueError("hysteresis must be smaller than threshold")
        return self


def pool_load(pool: PoolLoad, signal: Signal) -> int:
    """Load of the pool's healthy backends under the chosen signal."""
    total = 0
    for b in pool.backends:
        if not b.usable:
            continue
        if signal == "local":
            total += b.in_flight
        elif signal == "scraped":
            scraped = b.scraped
            total += b.in_flight if scraped is None else scraped
        else:
            total += b.load
    return total


class ThresholdPolicy:
    name = "threshold"
    reads_features = False

    def __init__(self, params: ThresholdParams, context: PolicyContext) -> None:
        self.params = params
        self._on_baseline = False
        # its only two answers, built once (a `Decision` is an immutable value)
        self._above = pool_decision("baseline", "above_threshold", policy=self.name)
        self._below = pool_decision("eagle", "below_threshold", policy=self.name)

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        p = self.params
        load = pool_load(view.eagle, p.signal)
        if self._on_baseline:
            if load < p.threshold - p.hysteresis:
                self._on_baseline = False
        elif load >= p.threshold:
            self._on_baseline = True
        return self._above if self._on_baseline else self._below

    def observe(self, outcome: Outcome) -> None:
        pass


SPEC = PolicySpec(
    name="threshold",
    params=ThresholdParams,
    factory=ThresholdPolicy,
    help="Eagle while the eagle pool's load is below `threshold` (with hysteresis), else baseline.",
)
