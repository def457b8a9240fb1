"""`fixed` and `threshold`: hand-computed decisions, bounds, hysteresis, load signals."""

from __future__ import annotations

import pytest
from helpers import Routed

from policies.base import BackendLoad, LoadView, NoHealthyBackend, Policy, PoolLoad, RequestInfo
from policies.registry import PolicyError, default_registry

REQ = RequestInfo(max_tokens=100)


def view(
    eagle_in_flight: int = 0,
    *,
    running: int | None = None,
    queued: int | None = None,
    eagle_usable: bool = True,
    baseline_usable: bool = True,
) -> LoadView:
    return LoadView(
        baseline=PoolLoad("baseline", (BackendLoad("b0", "baseline", usable=baseline_usable),)),
        eagle=PoolLoad(
            "eagle",
            (
                BackendLoad(
                    "e0",
                    "eagle",
                    usable=eagle_usable,
                    in_flight=eagle_in_flight,
                    running=running,
                    queued=queued,
                ),
            ),
        ),
    )


def threshold(**params: object) -> Policy:
    return Routed(default_registry(entry_points=False).create("threshold", params))


def fixed(pool: str = "baseline", seed: int = 0) -> Policy:
    return Routed(default_registry(entry_points=False).create("fixed", {"pool": pool}), seed)


def test_fixed_sends_everything_to_its_pool() -> None:
    for pool in ("baseline", "eagle"):
        policy = fixed(pool)
        for load in (0, 10, 1000):
            d = policy.choose(REQ, view(load), 0.0)
            assert (d.pool, d.reason, d.policy) == (pool, f"fixed_{pool}", "fixed")
            assert d.backend == ("b0" if pool == "baseline" else "e0")


def test_fixed_falls_back_when_its_pool_is_down() -> None:
    policy = fixed("eagle")
    d = policy.choose(REQ, view(eagle_usable=False), 0.0)
    assert (d.pool, d.reason) == ("baseline", "eagle_unavailable")
    with pytest.raises(NoHealthyBackend):
        policy.choose(REQ, view(eagle_usable=False, baseline_usable=False), 0.0)


def test_threshold_switches_exactly_at_its_bound() -> None:
    policy = threshold(threshold=4)
    pools = [policy.choose(REQ, view(load), 0.0).pool for load in (0, 1, 2, 3, 4, 5, 3, 4, 0)]
    assert pools == ["eagle"] * 4 + ["baseline"] * 2 + ["eagle", "baseline", "eagle"]


def test_threshold_hysteresis_band() -> None:
    policy = threshold(threshold=6, hysteresis=2)  # to baseline at 6, back to eagle below 4
    loads = [0, 5, 6, 5, 4, 3, 5, 6, 7, 4, 3]
    got = [policy.choose(REQ, view(load), 0.0) for load in loads]
    assert [d.pool for d in got] == [
        "eagle",  # 0
        "eagle",  # 5 < 6
        "baseline",  # 6 reaches the threshold
        "baseline",  # 5: inside the band
        "baseline",  # 4: inside the band (not below 4)
        "eagle",  # 3 < 6 - 2
        "eagle",  # 5 < 6
        "baseline",  # 6
        "baseline",
        "baseline",
        "eagle",
    ]
    assert {d.reason for d in got} == {"below_threshold", "above_threshold"}


def test_threshold_load_signals() -> None:
    # local in-flight 2, backend reports 5 running + 2 queued
    v = view(2, running=5, queued=2)
    assert threshold(threshold=3, signal="local").choose(REQ, v, 0.0).pool == "eagle"
    assert threshold(threshold=3, signal="scraped").choose(REQ, v, 0.0).pool == "baseline"
    assert threshold(threshold=3, signal="max").choose(REQ, v, 0.0).pool == "baseline"
    assert threshold(threshold=8, signal="scraped").choose(REQ, v, 0.0).pool == "eagle"  # 7 < 8
    # without a fresh sample, scraped falls back to the local count
    assert threshold(threshold=3, signal="scraped").choose(REQ, view(2), 0.0).pool == "eagle"
    # the local count wins under max when the sample lags behind
    assert threshold(threshold=3, signal="max").choose(REQ, view(4, running=1), 0.0).pool == "baseline"


def test_threshold_counts_only_healthy_eagle_backends() -> None:
    v = LoadView(
        baseline=PoolLoad("baseline", (BackendLoad("b0", "baseline"),)),
        eagle=PoolLoad(
            "eagle",
            (BackendLoad("e0", "eagle", in_flight=9, usable=False), BackendLoad("e1", "eagle", in_flight=1)),
        ),
    )
    d = threshold(threshold=4).choose(REQ, v, 0.0)
    assert (d.pool, d.backend) == ("eagle", "e1")


def test_threshold_eagle_down_goes_to_baseline() -> None:
    d = threshold().choose(REQ, view(eagle_usable=False), 0.0)
    assert (d.pool, d.reason) == ("baseline", "eagle_unavailable")


def test_forced_pool_is_honoured_and_leaves_hysteresis_alone() -> None:
    policy = threshold(threshold=4, hysteresis=2)
    assert policy.choose(REQ, view(5), 0.0).pool == "baseline"
    forced = policy.choose(RequestInfo(forced_pool="eagle"), view(5), 0.0)
    assert (forced.pool, forced.reason) == ("eagle", "client_override")
    assert policy.choose(REQ, view(3), 0.0).pool == "baseline"  # still inside the band


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"threshold": 4, "hysteresis": 4}, "hysteresis must be smaller than threshold"),
        ({"threshold": 0}, "threshold"),
        ({"signal": "psychic"}, "signal"),
        ({"treshold": 4}, "treshold"),
    ],
)
def test_threshold_bad_params_are_clear(params: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyError, match="policy 'threshold': invalid parameter") as info:
        threshold(**params)
    assert message in str(info.value)


def _pool_view(*backends: tuple[str, int, bool], running: dict[str, int] | None = None) -> LoadView:
    """A baseline pool of (name, in_flight, healthy) backends; `running`: scraped counts by name."""
    scraped = running or {}
    loads = tuple(
        BackendLoad(
            name,
            "baseline",
            usable=ok,
            in_flight=n,
            running=scraped.get(name),
            queued=0 if name in scraped else None,
        )
        for name, n, ok in backends
    )
    return LoadView(PoolLoad("baseline", loads), PoolLoad("eagle", (BackendLoad("e0", "eagle"),)))


def test_within_a_pool_the_least_loaded_healthy_backend_wins_ties_by_seeded_rng() -> None:
    policy = fixed()
    assert (
        policy.choose(REQ, _pool_view(("b0", 3, True), ("b1", 1, True), ("b2", 2, True)), 0.0).backend == "b1"
    )
    # an unhealthy backend is skipped however idle it is
    assert (
        policy.choose(REQ, _pool_view(("b0", 3, True), ("b1", 0, False), ("b2", 2, True)), 0.0).backend
        == "b2"
    )
    # the load is the larger of local in-flight and scraped running + queued
    busy = _pool_view(("b0", 0, True), ("b1", 1, True), running={"b0": 5})
    assert policy.choose(REQ, busy, 0.0).backend == "b1"

    tied = _pool_view(("b0", 2, True), ("b1", 2, True), ("b2", 2, True), ("b3", 9, True))

    def picks(seed: int) -> list[str]:
        routed = fixed(seed=seed)
        return [routed.choose(REQ, tied, 0.0).backend for _ in range(300)]

    first = picks(1)
    assert first == picks(1)  # reproducible for a seed
    assert first != picks(2)
    counts = {name: first.count(name) for name in ("b0", "b1", "b2", "b3")}
    assert counts["b3"] == 0 and all(counts[n] > 60 for n in ("b0", "b1", "b2")), counts
