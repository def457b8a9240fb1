"""Shadow policies: asked on every request, never acting.

Each shadow policy gets exactly the live policy's inputs (the same `RequestInfo`, the same
`LoadView` object, the same `now`), right after the live decision, in arrival order, so a
stateful policy (threshold hysteresis, `online`'s learning) evolves as it would if it were
live. Its choice is counted in `specroute_shadow_decisions_total{policy,pool,agrees}` and goes
into the decision log; routing never looks at it. When the request ends, every shadow policy
`observe`s the real outcome (the live decision and what happened), so `online` learns pool
speeds from real traffic while in shadow. A shadow policy that raises is logged (once per
policy and method) and skipped: it can never fail a request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from controller.proxy.config import ShadowPolicy
from controller.proxy.metrics import Metrics
from policies.base import Decision, LoadView, NoHealthyBackend, Outcome, Policy, RequestInfo
from policies.registry import PolicyRegistry
from policies.routing import Router
from policies.spec import PolicyContext, PolicyError

log = logging.getLogger("specroute.shadow")


@dataclass(frozen=True, slots=True)
class ShadowChoice:
    label: str
    """The shadow policy's metric label (its configured `label`, else its name)."""
    decision: Decision


def build_shadows(
    specs: Sequence[ShadowPolicy], registry: PolicyRegistry, context: PolicyContext
) -> list[tuple[str, Policy]]:
    """Create the configured shadow policies; raises PolicyError naming the bad entry."""
    out: list[tuple[str, Policy]] = []
    for i, spec in enumerate(specs):
        try:
            policy = registry.create(spec.name, spec.params, context)
        except PolicyError as e:
            raise PolicyError(f"shadow_policies[{i}]: {e}") from None
        out.append((spec.label or spec.name, policy))
    return out


class ShadowPolicies:
    def __init__(self, policies: Sequence[tuple[str, Policy]], metrics: Metrics) -> None:
        labels = [label for label, _ in policies]
        if len(set(labels)) != len(labels):
            raise PolicyError("shadow policies need distinct labels (set `label` on repeated policies)")
        self.policies = list(policies)
        self.metrics = metrics
        self.router = Router(0)
        """Shadow decisions go through the routing core like live ones (its own tie-break RNG)."""
        self._failed: set[tuple[str, str]] = set()

    def __bool__(self) -> bool:
        return bool(self.policies)

    def decide(
        self, info: RequestInfo, view: LoadView, now: float, live: Decision
    ) -> tuple[ShadowChoice, ...]:
        out = []
        for label, policy in self.policies:
            try:
                decision = self.router.decide(policy, info, view, now)
            except NoHealthyBackend:
                continue
            except Exception:
                self._fail(label, "choose")
                continue
            self.metrics.shadow_decision(label, decision.pool, decision.pool == live.pool)
            out.append(ShadowChoice(label, decision))
        return tuple(out)

    def observe(self, outcome: Outcome) -> None:
        for label, policy in self.policies:
            try:
                policy.observe(outcome)
            except Exception:
                self._fail(label, "observe")

    def _fail(self, label: str, method: str) -> None:
        if (label, method) not in self._failed:
            self._failed.add((label, method))
            log.exception("shadow policy %r failed in %s() (logged once; routing unaffected)", label, method)
