"""`round_robin`: every healthy backend of both pools in turn, blind to load, mode and cache.

A comparison router (the cache routing benchmark's floor): it cycles through the backends in
deployment order (baseline pool first) and names the next healthy one.
"""

from __future__ import annotations

from policies.base import Decision, LoadView, NoHealthyBackend, Outcome, RequestInfo
from policies.spec import NoParams, PolicyContext, PolicySpec


class RoundRobinPolicy:
    name = "round_robin"
    reads_features = False

    def __init__(self, params: NoParams, context: PolicyContext) -> None:
        self._next = 0

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        backends = view.baseline.backends + view.eagle.backends
        count = len(backends)
        for k in range(count):
            b = backends[(self._next + k) % count]
            if b.admits:
                self._next = (self._next + k + 1) % count
                return Decision(b.pool, b.name, "round_robin", {}, {}, 0, self.name)
        raise NoHealthyBackend("no healthy backend in either pool")

    def observe(self, outcome: Outcome) -> None:
        pass


SPEC = PolicySpec(
    name="round_robin",
    params=NoParams,
    factory=RoundRobinPolicy,
    help="Every healthy backend of both pools in turn (a comparison router: blind to load, mode and cache).",
)
