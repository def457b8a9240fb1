"""Exploration with a budget: `cost_model` sometimes sends a request to EAGLE when it predicts
the plain pool cheaper, to learn what it does not know yet about that request's kind.

Why: a content model learns a request kind's EAGLE speed only from requests of that kind that ran
on EAGLE. A kind predicted slow there is never sent there, so a wrong prediction (too few
outcomes, a profile whose EAGLE lead is small, a poisoned family) is never corrected: a bandit
without exploration starves itself of the outcomes it learns from.

How it works. The request's predicted speed factor comes with its uncertainty (the standard
deviation of `policies.acceptance.AcceptanceModel.predict_spread`, in log space). When the plain
pool is chosen, the explorer draws how much faster on EAGLE the request might plausibly be:

- `optimistic` (cost_model's default): the upper bound `mean + z x sd`;
- `thompson`: a sample of the factor from its predictive distribution (a normal in log space).

Both find what pays where the pool average hides it (tests/policies/test_explore.py). Where
nothing is to be found they differ: in the simulated twin of issue 33's live setting with
acceptance that does not depend on content, Thompson sampling explored 0.2% of decisions and
spent 6% of its budget for nothing, the optimistic bound none; with the live setting's rules
(code 1.5x, prose 0.7x) 1.2% and 27% against 0.7% and 8%, and the bound's mean and p99 end-to-end
times against content-blind routing's were -1.8% and +4.3% against Thompson's -1.7% and +5.6%
(`benchmarks/content_routing_explore.py`, 10 seeds).

If EAGLE is cheaper at that factor (the policy's own comparison, re-run with it), the request goes
to EAGLE with reason `explore`, provided the budget covers the predicted regret: the cost by
which EAGLE was predicted worse (the policy's compared quantity: marginal cost in system scope).
The budget accrues `budget` x the chosen pool's predicted e2e per decision on a request with
content (one without has nothing to explore), so in steady state the regret spent is at most that
share of those requests' predicted end-to-end time; it holds at most
`CREDIT_DECISIONS` decisions' worth, so no exploration costs more than that many decisions'
allowance and a quiet period does not save up for a burst. Exploring is cheap at low load (the
pools' costs are close), likely where the uncertainty is large, and worth it where a gain is
plausible; where the prediction is confident, draws rarely cross.

Only EAGLE is explored: the plain pool's speed does not depend on content, so a plain outcome
teaches nothing about a request's kind. Randomness comes from the `random.Random` passed in
(seeded by the policy context): the simulator reproduces the proxy's choices. The counters are
plain attributes (`state` / `load_state`).
"""

from __future__ import annotations

import math
import random
from typing import Any, Literal

ExploreMode = Literal["thompson", "optimistic"]
CREDIT_DECISIONS = 50
"""The credit holds at most this many decisions' allowance."""


class Explorer:
    """See the module docstring."""

    def __init__(self, mode: ExploreMode, budget: float, z: float, rng: random.Random) -> None:
        self.mode = mode
        self.budget = budget
        self.z = z
        self._rng = rng
        self.credit = 0.0
        """Predicted regret (seconds) that may be spent now."""
        self.allowed = 0.0
        """Everything the budget allowed so far (seconds)."""
        self.spent = 0.0
        """Predicted regret spent on explorations so far (seconds)."""
        self.decisions = 0
        self.explored = 0

    def affords(self, regret: float) -> bool:
        return 0.0 <= regret <= self.credit

    def draw(self, sd: float) -> float:
        """How much faster (log factor) than predicted the request is taken to be on EAGLE."""
        if self.mode == "thompson":
            return sd * self._rng.gauss(0.0, 1.0)
        return self.z * sd

    def spend(self, regret: float) -> None:
        self.credit -= regret
        self.spent += regret
        self.explored += 1

    def accrue(self, e2e: float) -> None:
        """One decision made; `e2e`: the chosen pool's predicted end-to-end seconds."""
        self.decisions += 1
        if not 0.0 < e2e < math.inf:
            return
        allowance = self.budget * e2e
        self.allowed += allowance
        self.credit = min(self.credit + allowance, CREDIT_DECISIONS * allowance)

    @property
    def share(self) -> float:
        """Decisions that explored, over all decisions."""
        return self.explored / self.decisions if self.decisions else 0.0

    @property
    def spent_ratio(self) -> float:
        """Regret spent over what the budget allowed (at most 1 by construction)."""
        return self.spent / self.allowed if self.allowed else 0.0

    def state(self) -> dict[str, Any]:
        return {
            "credit": self.credit,
            "allowed": self.allowed,
            "spent": self.spent,
            "decisions": self.decisions,
            "explored": self.explored,
        }

    def load_state(self, state: Any) -> None:
        """Take back what `state` returned; ValueError (and nothing changed) when it cannot."""
        try:
            values = (
                float(state["credit"]),
                float(state["allowed"]),
                float(state["spent"]),
                int(state["decisions"]),
                int(state["explored"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"explorer state: {e!r}") from None
        if any(isinstance(state[k], bool) for k in ("credit", "allowed", "spent", "decisions", "explored")):
            raise ValueError("explorer state: a bool is not a number")
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError("explorer state: negative or not finite")
        self.credit, self.allowed, self.spent = values[0], values[1], values[2]
        self.decisions, self.explored = int(values[3]), int(values[4])
