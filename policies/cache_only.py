"""`cache_only`: the backend holding the longest prefix of the prompt, ties to the least loaded.

A comparison router modelled on SGLang's cache-aware router: the backend of either pool with the
most `cached_tokens` (from the prefix index), among equals the one with the least load, among
equals a seeded random one. Blind to speculation modes and to how much the load costs.
"""

from __future__ import annotations

import random

from policies.base import BackendLoad, Decision, LoadView, NoHealthyBackend, Outcome, RequestInfo
from policies.spec import NoParams, PolicyContext, PolicySpec


class CacheOnlyPolicy:
    name = "cache_only"
    reads_features = False

    def __init__(self, params: NoParams, context: PolicyContext) -> None:
        self._rng = random.Random(f"{context.seed}/cache_only")

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        best: list[BackendLoad] = []
        best_key = (0, 0)
        for b in view.baseline.backends + view.eagle.backends:
            if b.admits:
                key = (-b.cached_tokens, b.load)
                if not best or key < best_key:
                    best, best_key = [b], key
                elif key == best_key:
                    best.append(b)
        if not best:
            raise NoHealthyBackend("no healthy backend in either pool")
        chosen = best[0] if len(best) == 1 else best[self._rng.randrange(len(best))]
        reason = "prefix_match" if chosen.cached_tokens > 0 else "least_loaded"
        return Decision(chosen.pool, chosen.name, reason, {}, {}, 0, self.name)

    def observe(self, outcome: Outcome) -> None:
        pass


SPEC = PolicySpec(
    name="cache_only",
    params=NoParams,
    factory=CacheOnlyPolicy,
    help="The backend (either pool) holding the longest prefix of the prompt, ties to the least loaded, "
    "as SGLang's cache-aware router (a comparison router: blind to speculation modes).",
)
