"""Prefix-cache awareness in the policies: cost_model sends a long context where it is cached
unless that backend is overloaded, books the prefill it sends, and with prefix_aware=false
ignores cached_tokens; the comparison routers round_robin and cache_only."""

from __future__ import annotations

import pytest
from helpers import KIMI, Routed

from policies.base import BackendLoad, LoadView, NoHealthyBackend, Policy, PoolLoad, RequestInfo
from policies.profile import parse_profile, resolve_profile
from policies.registry import PolicyContext, default_registry
from policies.routing import reset

LONG = RequestInfo(prompt_tokens=32_000, max_tokens=256)


def policy(name: str = "cost_model", seed: int = 0, **params: object) -> Policy:
    return Routed(default_registry(entry_points=False).create(name, params, PolicyContext(KIMI, seed)), seed)


def b(name: str, running: int = 0, cached: int = 0, usable: bool = True) -> BackendLoad:
    pool = "eagle" if name.startswith("e") else "baseline"
    return BackendLoad(name, pool, usable, running=running, queued=0, cached_tokens=cached)  # type: ignore[arg-type]


def view(baseline: list[BackendLoad], eagle: list[BackendLoad]) -> LoadView:
    return LoadView(PoolLoad("baseline", tuple(baseline)), PoolLoad("eagle", tuple(eagle)))


def test_a_long_context_goes_to_the_backend_that_holds_it() -> None:
    busy_eagle = [b("e0", running=48)]
    d = policy().choose(LONG, view([b("b0", 10), b("b1", 10, cached=30_000)], busy_eagle), 0.0)
    assert (d.pool, d.backend) == ("baseline", "b1")
    # ... and across pools: idle, the plain server wins this request by a little (6.95 vs 7.08 s
    # predicted), but 30k of its 32k tokens cached on the eagle server save 3.9 s of prefill
    cold = policy().choose(LONG, view([b("b0")], [b("e0")]), 0.0)
    warm = policy().choose(LONG, view([b("b0")], [b("e0", cached=30_000)]), 0.0)
    assert cold.pool == "baseline" and warm.pool == "eagle"
    assert warm.predicted_ttft_s["eagle"] == pytest.approx(cold.predicted_ttft_s["eagle"] - 30_000 / 7600)


def test_unless_that_backend_is_overloaded() -> None:
    busy_eagle = [b("e0", running=48)]
    d = policy().choose(LONG, view([b("b0", 0), b("b1", 200, cached=30_000)], busy_eagle), 0.0)
    assert d.backend == "b0"  # 3.75 s of prefill saved does not pay for decoding in a batch of 201
    # nor in a batch of 21 (255 tokens 6.4 s slower, and 20 others slowed), but with 3 running it does
    predicted = d.predicted_e2e_s["baseline"]
    d1 = policy().choose(LONG, view([b("b0", 0), b("b1", 3, cached=30_000)], busy_eagle), 0.0)
    assert d1.backend == "b1" and d1.predicted_e2e_s["baseline"] < predicted


def test_queued_prefill_spreads_long_prompts() -> None:
    p = policy()
    busy_eagle = [b("e0", running=48)]
    idle = view([b("b0"), b("b1")], busy_eagle)
    first, second = p.choose(LONG, idle, 0.0), p.choose(LONG, idle, 0.0)
    assert (first.backend, second.backend) == ("b0", "b1")  # b0 is still prefilling 32k tokens (4 s)
    assert second.predicted_ttft_s["baseline"] == pytest.approx(first.predicted_ttft_s["baseline"])
    third = p.choose(LONG, idle, 0.0)  # both busy: b0 drains first
    assert third.backend == "b0"
    assert third.predicted_ttft_s["baseline"] == pytest.approx(first.predicted_ttft_s["baseline"] + 4.0)
    assert p.choose(LONG, idle, 100.0).predicted_ttft_s["baseline"] == pytest.approx(
        first.predicted_ttft_s["baseline"]
    )  # drained by then


def test_prefix_aware_false_ignores_cached_tokens() -> None:
    for loads in ((0, 0, 0), (10, 30, 5), (200, 3, 48)):
        plain = view([b("b0", loads[0]), b("b1", loads[1])], [b("e0", loads[2])])
        cached = view(
            [b("b0", loads[0], cached=30_000), b("b1", loads[1])], [b("e0", loads[2], cached=20_000)]
        )
        for now in (0.0, 0.0, 1.0):  # no prefill booked either: repeating a request changes nothing
            blind = policy(prefix_aware=False).choose(LONG, cached, now)
            reference = policy(prefix_aware=False).choose(LONG, plain, now)
            assert (blind.pool, blind.backend, blind.reason) == (
                reference.pool,
                reference.backend,
                reference.reason,
            )
            assert blind.predicted_e2e_s == reference.predicted_e2e_s
            assert blind.predicted_ttft_s == reference.predicted_ttft_s


def test_prefix_aware_is_a_documented_parameter() -> None:
    rows = {r[0]: r for r in default_registry(entry_points=False).get("cost_model").describe_params()}
    assert rows["prefix_aware"][1:3] == ("bool", "true")
    assert rows["prefill_tok_s"][2] == "10000.0"
    with pytest.raises(Exception, match="prefill_tok_s"):
        policy(prefill_tok_s=0)


def test_cached_tokens_are_credited_when_the_profile_has_no_prefill_rate() -> None:
    llama = resolve_profile("llama31-8b-h100-eagle3")
    data = llama.model_dump(mode="json")
    for mode in data["modes"].values():
        del mode["prefill_tok_s"]
    bare = parse_profile(data)
    p = default_registry(entry_points=False).create(
        "cost_model", {"prefill_tok_s": 5000}, PolicyContext(bare)
    )
    req = RequestInfo(prompt_tokens=1000, max_tokens=100)
    cold = Routed(p).choose(req, view([b("b0", 30)], [b("e0", 30)]), 0.0)
    warm = Routed(p).choose(req, view([b("b0", 30)], [b("e0", 30, cached=100)]), 0.0)
    # 100 cached tokens at 5000 tok/s save 20 ms, never more than the TTFT itself
    assert warm.predicted_ttft_s["eagle"] == pytest.approx(cold.predicted_ttft_s["eagle"] - 0.02)
    most = Routed(p).choose(req, view([b("b0", 30)], [b("e0", 30, cached=1000)]), 0.0)
    assert 0.0 <= most.predicted_ttft_s["eagle"] < 0.001  # ttft(31) - ttft(30): 0.6 ms


def test_round_robin_cycles_through_healthy_backends() -> None:
    p = policy("round_robin")
    v = view([b("b0"), b("b1", usable=False)], [b("e0"), b("e1")])
    picks = [p.choose(LONG, v, 0.0) for _ in range(6)]
    assert [d.backend for d in picks] == ["b0", "e0", "e1"] * 2
    assert [d.pool for d in picks[:3]] == ["baseline", "eagle", "eagle"]
    assert {d.reason for d in picks} == {"round_robin"}
    with pytest.raises(NoHealthyBackend):
        p.choose(LONG, view([b("b0", usable=False)], [b("e0", usable=False)]), 0.0)


def test_cache_only_takes_the_longest_prefix_then_the_least_loaded() -> None:
    p = policy("cache_only")
    d = p.choose(
        LONG, view([b("b0", 0, cached=512), b("b1", 100, cached=2048)], [b("e0", 0, cached=1024)]), 0.0
    )
    assert (d.backend, d.reason) == ("b1", "prefix_match")  # load ignored when a longer prefix exists
    d = p.choose(LONG, view([b("b0", 5, cached=512), b("b1", 3, cached=512)], [b("e0", 0)]), 0.0)
    assert d.backend == "b1"
    d = p.choose(LONG, view([b("b0", 5)], [b("e0", 2), b("e1", 2, usable=False)]), 0.0)
    assert (d.backend, d.reason) == ("e0", "least_loaded")
    ties = {
        policy("cache_only", seed=s).choose(LONG, view([b("b0")], [b("e0")]), 0.0).backend for s in range(20)
    }
    assert ties == {"b0", "e0"}  # exact ties broken by the seeded RNG
    with pytest.raises(NoHealthyBackend):
        p.choose(LONG, view([], [b("e0", usable=False)]), 0.0)


def test_a_segment_start_drops_the_booked_prefill() -> None:
    p = policy()
    idle = view([b("b0"), b("b1")], [b("e0", running=48)])
    first = p.choose(LONG, idle, 50.0)
    assert p.choose(LONG, idle, 50.0).backend == "b1"  # b0 prefills until 54 s
    reset(p)  # the simulator starts its next segment (clock at 0)
    again = p.choose(LONG, idle, 0.0)
    assert again.backend == "b0" and again.predicted_ttft_s == first.predicted_ttft_s
