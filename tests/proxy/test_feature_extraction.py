"""A request's content features (`policies.features`, 6-25 us each) are extracted only when the
live policy or a shadow policy may read them (`policies.base.reads_features`): content-aware
routing gets them, a content-blind deployment does not pay for them. Through the real proxy
app, with the openai client; what the policy was handed is read from the request records."""

from __future__ import annotations

from typing import Any

import pytest

from controller.proxy.config import Settings
from controller.proxy.core import policy_context
from policies.base import Decision, LoadView, Outcome, Policy, RequestInfo, reads_features
from policies.registry import default_registry

CHAT = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "def fib(n): return the n-th Fibonacci number"},
]
PROFILE = "kimi-k25-int4-8gpu"


class SeesFeatures:
    """A plug-in policy that does not say whether it reads features: it is handed them."""

    name = "sees_features"

    def __init__(self) -> None:
        self.seen: list[RequestInfo] = []

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        self.seen.append(request)
        return Decision("baseline", "", "plugin", {}, {}, 0, self.name)

    def observe(self, outcome: Outcome) -> None:
        pass


async def _ask(p: Any) -> RequestInfo:
    client = p.client()
    await client.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
    await client.close()
    await p.wait_idle()
    request: RequestInfo = p.records[-1].request
    return request


@pytest.mark.parametrize(
    ("policy", "params", "extracted"),
    [
        ("cost_model", {}, True),  # content_aware by default
        ("cost_model", {"content_aware": False}, False),
        ("fixed", {"pool": "baseline"}, False),
        ("threshold", {}, False),
        ("online", {}, False),
        ("round_robin", {}, False),
        ("cache_only", {}, False),
    ],
)
async def test_features_are_extracted_only_for_a_policy_that_reads_them(
    fake_backend, proxy, policy: str, params: dict[str, Any], extracted: bool
):
    base, eagle = await fake_backend(), await fake_backend()
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy=policy, policy_params=params, profile=PROFILE,
        health_checks=False,
    )  # fmt: skip
    assert reads_features(p.forwarder.policy) is extracted
    request = await _ask(p)
    if extracted:
        assert request.features is not None and request.features.family != 0 and request.features.grams
    else:
        assert request.features is None


async def test_a_content_aware_shadow_gets_features_behind_a_content_blind_policy(fake_backend, proxy):
    base, eagle = await fake_backend(), await fake_backend()
    settings = Settings(baseline=[base.url], eagle=[eagle.url], profile=PROFILE)
    aware = default_registry(entry_points=False).create("cost_model", {}, policy_context(settings))
    shadows: list[tuple[str, Policy]] = [("aware", aware)]
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="fixed", policy_params={"pool": "baseline"},
        profile=PROFILE, shadows=shadows, health_checks=False,
    )  # fmt: skip
    request = await _ask(p)
    assert request.features is not None and request.features.grams
    assert p.records[-1].shadow[0].label == "aware"


async def test_a_policy_that_does_not_say_is_handed_features(fake_backend, proxy):
    base = await fake_backend()
    p = await proxy(baseline=[base.url], policy="fixed", health_checks=False)
    plugin = SeesFeatures()
    p.forwarder.policy = plugin  # as POST /admin/policy swaps it
    await _ask(p)
    assert plugin.seen[-1].features is not None
