"""Exploration with a budget (`policies/explore.py`): a content-aware cost_model tries EAGLE for
request kinds it predicts slower there while it is unsure, learns the ones that pay, spends no more
predicted regret than its budget, and is deterministic for a seed."""

from __future__ import annotations

import json
import random

import pytest
from helpers import Routed

from policies.base import BackendLoad, Decision, LoadView, Outcome, PoolLoad, RequestInfo
from policies.explore import Explorer
from policies.features import extract_features
from policies.profile import resolve_profile
from policies.registry import PolicyContext, default_registry

KIMI = resolve_profile("kimi-k25-int4-8gpu")
ACCEPT = KIMI.mode("eagle").accept_length or 1.0
TRUTH = {"code": 1.5, "prose": 0.7, "math": 1.0}


def cost_model(seed: int = 0, **params: object) -> Routed:
    """The load each request sees here is held fixed (`busy()`, a tilted view), whatever the policy
    sends: the arrival count, which measures what the policy sends, is off."""
    registry = default_registry(entry_points=False)
    params = {"count_arrivals": False, **params}
    return Routed(registry.create("cost_model", params, PolicyContext(KIMI, seed)), seed)


def request(kind: str, i: int) -> RequestInfo:
    text = {
        "code": f"Complete the following Python function.\n\ndef f{i}(xs):\n    return sorted(xs)[{i % 7}]\n",
        "prose": f"Write a short poem about lantern number {i}, with a twist at the end.",
        "math": f"A shop sells {i} apples at 3 dollars each. How much do {i + 2} apples cost?",
    }[kind]
    features = extract_features({"messages": [{"role": "user", "content": text}]}, "chat")
    return RequestInfo(max_tokens=200, features=features)


def busy() -> LoadView:
    """One request on each pool: EAGLE pays here only for a request above the profile's
    acceptance (the kimi profile's EAGLE lead is 3.7% for a lone stream)."""
    return LoadView(
        PoolLoad("baseline", (BackendLoad("b0", "baseline", running=1, queued=0),)),
        PoolLoad("eagle", (BackendLoad("e0", "eagle", running=1, queued=0),)),
    )


def serve(policy: Routed, kinds: list[str], start: int = 0) -> list[tuple[str, Decision]]:
    """Route each request and report what its backend would: EAGLE's accept length (spec_details)
    follows the kind's true factor; the plain pool's decode rate is the profile's."""
    out = []
    for i, kind in enumerate(kinds, start):
        info = request(kind, i)
        d = policy.choose(info, busy(), float(i))
        if d.pool == "eagle":
            step = KIMI.speed("eagle").step_time(2) / TRUTH[kind]
            accept = ACCEPT * TRUTH[kind]
        else:
            step, accept = KIMI.speed("baseline").step_time(2), None
        policy.observe(Outcome(info, d, float(i), 0.2, 200, 0.2 + 199 * step, "ok", accept))
        out.append((kind, d))
    return out


def kinds(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(list(TRUTH)) for _ in range(n)]


def eagle_share(routed: list[tuple[str, Decision]], kind: str) -> float:
    picked = [d for k, d in routed if k == kind]
    return sum(d.pool == "eagle" for d in picked) / len(picked)


@pytest.mark.parametrize("mode", ["thompson", "optimistic"])
def test_exploration_finds_the_kind_that_pays_and_stays_in_budget(mode: str) -> None:
    blind_start = cost_model(explore_budget=0)
    policy = cost_model(explore=mode)
    traffic = kinds(1200, 1)
    never = serve(blind_start, traffic)
    tried = serve(policy, traffic)
    # without exploration the pool average decides for every kind: nothing reaches EAGLE, nothing is learned
    assert all(d.pool == "baseline" for _, d in never)
    assert blind_start.policy.content.model.taught == 0  # type: ignore[attr-defined]
    # with it, code (1.5x) is found to pay and then goes there as the faster pool; prose does not
    late = tried[600:]
    assert eagle_share(late, "code") > 0.8
    assert eagle_share(late, "prose") < 0.1
    assert any(d.reason == "faster_eagle" for k, d in late if k == "code")
    explorer = policy.policy.explorer  # type: ignore[attr-defined]
    assert isinstance(explorer, Explorer)
    explored = sum(d.reason == "explore" for _, d in tried)
    assert explored == explorer.explored > 0
    assert explorer.decisions == len(tried)
    # the predicted regret spent is within what the budget allowed: 1% of the predicted e2e
    assert explorer.spent <= explorer.allowed + 1e-9
    e2e = sum(d.predicted_e2e_s[d.pool] for _, d in tried)
    assert explorer.allowed == pytest.approx(0.01 * e2e, rel=1e-6)
    assert 0.0 < explorer.spent_ratio <= 1.0
    assert 0.0 < explorer.share < 0.2


def test_budget_zero_never_explores_and_runs_are_deterministic() -> None:
    traffic = kinds(400, 2)
    off = serve(cost_model(explore_budget=0), traffic)
    assert not any(d.reason == "explore" for _, d in off)
    assert cost_model(explore_budget=0).policy.explorer is None  # type: ignore[attr-defined]

    def decisions(seed: int, mode: str) -> list[tuple[str, str]]:
        return [(d.pool, d.reason) for _, d in serve(cost_model(seed, explore=mode), traffic)]

    assert decisions(3, "thompson") == decisions(3, "thompson")
    assert decisions(3, "thompson") != decisions(4, "thompson")  # the draws come from the seeded RNG
    assert decisions(3, "optimistic") == decisions(4, "optimistic")  # the bound draws nothing


def test_a_confident_prediction_is_rarely_explored() -> None:
    """Once prose is known to be slow on EAGLE, draws seldom cross: exploration fades."""
    policy = cost_model()
    serve(policy, kinds(1500, 5))
    explorer = policy.policy.explorer  # type: ignore[attr-defined]
    before = explorer.explored
    late = serve(policy, ["prose"] * 300, start=10_000)
    assert sum(d.reason == "explore" for _, d in late) == explorer.explored - before <= 6


def test_explorer_state_round_trips() -> None:
    policy = cost_model()
    serve(policy, kinds(300, 6))
    explorer = policy.policy.explorer  # type: ignore[attr-defined]
    saved = json.loads(json.dumps(explorer.state()))
    fresh = cost_model().policy.explorer  # type: ignore[attr-defined]
    fresh.load_state(saved)
    assert fresh.state() == saved
    with pytest.raises(ValueError, match="explorer state"):
        fresh.load_state({"credit": "x"})
    with pytest.raises(ValueError, match="negative"):
        fresh.load_state({**saved, "credit": -1.0})
    assert fresh.state() == saved


def test_a_kind_known_slow_is_not_explored_next_to_a_busy_plain_server() -> None:
    """What exploring draws from is the uncertainty of the kind's expected factor, which shrinks as
    its outcomes accumulate, not one request's scatter: once prose is learned slow on EAGLE it is
    no longer tried there, even where a try is cheap (an idle EAGLE server beside a plain one
    running two). Drawing from one request's scatter, a third of those prose requests explored."""
    policy = cost_model()
    serve(policy, kinds(600, 7))
    tilted = LoadView(
        PoolLoad("baseline", (BackendLoad("b0", "baseline", running=2, queued=0),)),
        PoolLoad("eagle", (BackendLoad("e0", "eagle", running=0, queued=0),)),
    )
    reasons = []
    for i in range(10_000, 10_300):
        info = request("prose", i)
        d = policy.choose(info, tilted, float(i))
        reasons.append(d.reason)
        accept = ACCEPT * TRUTH["prose"] if d.pool == "eagle" else None
        policy.observe(Outcome(info, d, float(i), 0.2, 200, 40.0, "ok", accept))
    assert policy.policy._content_own[1] == pytest.approx(0.7, abs=0.02)  # type: ignore[attr-defined]
    assert reasons[:100].count("explore") >= 1  # it was tried while unknown
    assert reasons[100:].count("explore") <= 3, reasons[100:].count("explore")


def test_a_kinds_uncertainty_shrinks_with_its_outcomes_and_grows_when_stale() -> None:
    """The spread behind a prediction falls as outcomes of the request's kind accumulate; a family
    that stops being taught grows uncertain again (and so is re-tried)."""
    from policies.acceptance import AcceptanceModel

    model = AcceptanceModel(stale_after=100)
    body = {
        "messages": [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "A poem."}]
    }
    features = extract_features(body, "chat")
    other = extract_features({"messages": [{"role": "user", "content": "def f(x):\n    return x"}]}, "chat")
    spreads = []
    for _ in range(40):
        spreads.append(model.predict_spread(features, None, 0.0, 1000.0)[1])
        model.learn(features, None, -0.35, 0.0)
        model.learn(other, None, 0.4, 0.0)
    assert spreads[-1] < spreads[5] / 2, spreads
    fresh = model.predict_spread(features, None, 0.0, 1000.0)[1]
    for _ in range(400):  # predictions of other requests: the family's evidence ages
        model.predict_spread(other, None, 0.0, 1000.0)
    assert model.predict_spread(features, None, 0.0, 1000.0)[1] > 2 * fresh
