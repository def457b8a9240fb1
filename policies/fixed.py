"""`fixed`: every request to one pool. The reference lines for every comparison."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from policies.base import Decision, LoadView, Outcome, Pool, RequestInfo
from policies.routing import pool_decision
from policies.spec import PolicyContext, PolicySpec


class FixedParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pool: Pool = Field(default="baseline", description="Pool that receives all traffic.")


class FixedPolicy:
    name = "fixed"
    reads_features = False

    def __init__(self, params: FixedParams, context: PolicyContext) -> None:
        self.params = params
        self._reason = f"fixed_{params.pool}"

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        return pool_decision(self.params.pool, self._reason, policy=self.name)

    def observe(self, outcome: Outcome) -> None:
        pass


SPEC = PolicySpec(
    name="fixed",
    params=FixedParams,
    factory=FixedPolicy,
    help="Send every request to one pool (pool=baseline|eagle).",
)
