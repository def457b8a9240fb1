"""Content-aware routing, observed: how far each request's predicted EAGLE speed factor was from
the one its backend reported, and how many prompt families the acceptance model tracks.

`AcceptanceMetrics` is a request observer (`Forwarder.observers`): once a request served by an
eagle backend with `spec_details` on has ended, it observes reported / predicted (the predicted
factor is `Decision.accept_factor`, the reported one the accept length over the profile's) in
`specroute_accept_factor_ratio`. `specroute_acceptance_families` is read from the live policy at
scrape time (a reloaded policy starts from zero), and so are the exploration's figures
(`policies/explore.py`): `specroute_exploration_share` (decisions that explored over all) and
`specroute_exploration_budget_spent_ratio` (predicted regret spent over what `explore_budget`
allowed), with the regret itself in `specroute_exploration_regret_seconds`. A policy without a
content model adds nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from controller.proxy.ticket import RequestRecord
from policies.base import Outcome, Policy
from policies.content import ContentAcceptance
from policies.explore import Explorer

RATIO_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0)


def content_model(policy: Policy) -> ContentAcceptance | None:
    """The policy's content model (cost_model with content_aware), or None."""
    content = getattr(policy, "content", None)
    return content if isinstance(content, ContentAcceptance) else None


def reported_factor(policy: Policy, outcome: Outcome) -> float | None:
    """The eagle speed factor the backend reported for the request (None: not reported)."""
    content = content_model(policy)
    if content is None or outcome.decision.pool != "eagle" or outcome.status != "ok":
        return None
    return content.reported(outcome)


class _Families:
    def __init__(self, policy: Callable[[], Policy]) -> None:
        self._policy = policy

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "specroute_acceptance_families",
            "Prompt families the live policy's acceptance model tracks (content-aware cost_model).",
        )
        policy = self._policy()
        content = content_model(policy)
        gauge.add_metric([], 0 if content is None else content.model.families)
        yield gauge
        explorer = getattr(policy, "explorer", None)
        explorer = explorer if isinstance(explorer, Explorer) else None
        for name, doc, value in (
            (
                "specroute_exploration_share",
                "Decisions of the live policy that explored (sent to EAGLE to learn: reason explore) over "
                "all.",
                0.0 if explorer is None else explorer.share,
            ),
            (
                "specroute_exploration_budget_spent_ratio",
                "Predicted regret exploration spent over what explore_budget allowed (at most 1).",
                0.0 if explorer is None else explorer.spent_ratio,
            ),
            (
                "specroute_exploration_regret_seconds",
                "Predicted regret exploration spent so far (seconds of predicted cost).",
                0.0 if explorer is None else explorer.spent,
            ),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g


class AcceptanceMetrics:
    """Request observer; see the module docstring."""

    def __init__(self, registry: CollectorRegistry, policy: Callable[[], Policy]) -> None:
        self.ratio = Histogram(
            "specroute_accept_factor_ratio",
            "Reported / predicted EAGLE speed factor of requests served by eagle with spec_details "
            "(1 = predicted exactly; the prediction is what content-aware routing used).",
            ["policy"],
            buckets=RATIO_BUCKETS,
            registry=registry,
        )
        registry.register(_Families(policy))

    def __call__(self, record: RequestRecord) -> None:
        predicted = record.decision.accept_factor
        if predicted is None or not predicted > 0.0:
            return
        reported = reported_factor(record.policy, record.outcome)
        if reported is not None:
            self.ratio.labels(record.policy.name).observe(reported / predicted)
