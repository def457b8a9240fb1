"""A user policy loaded by import path (`--policy plugin_policy_example:AlternatingPolicy`).

It is also what a third-party package would register under the `specroute.policies` entry
point group. The other classes here are deliberately broken, for the error tests.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

from policies.base import Decision, LoadView, Outcome, Pool, RequestInfo, other_pool
from policies.registry import PolicyContext
from policies.routing import route


class AlternatingPolicy:
    """Alternate between the pools, one request each."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        first: Pool = Field(default="baseline", description="Pool of the first request.")

    name = "alternating"

    def __init__(self, params: Params, context: PolicyContext) -> None:
        self._next: Pool = params.first
        self._rng = random.Random(context.seed)
        self.observed = 0

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        pool, self._next = self._next, other_pool(self._next)
        return route(view, pool, "alternate", self._rng, policy=self.name)

    def observe(self, outcome: Outcome) -> None:
        self.observed += 1


class NotAPolicy:
    """Has no choose() or observe()."""


class BadParams:
    Params = dict

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        raise NotImplementedError

    def observe(self, outcome: Outcome) -> None:
        pass


class FailsToStart:
    """Raises in its constructor."""

    def __init__(self, params: BaseModel, context: PolicyContext) -> None:
        raise RuntimeError("no GPU here")

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        raise NotImplementedError

    def observe(self, outcome: Outcome) -> None:
        pass
