"""The values of `policies.base`: every field is set once, by the constructor, and never assigned
again.

`BackendLoad` and `Decision` refuse an assignment or a deletion themselves
(`dataclasses.FrozenInstanceError`), in the pure Python and in the compiled build
(tests/simulator/test_native.py checks the build). `PoolLoad`, `LoadView` and `Outcome` are kept
to the rule by these tests: they are made to refuse a second assignment, and the routing core,
every built-in policy, the simulator (one router, several routers, prefix caches, closed and
open loops) and the proxy's view and failover path run through them: any code that changes a
value after building it fails these tests.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import make_tracker

from policies.base import BackendLoad, Decision, LoadView, Outcome, PoolLoad, RequestInfo
from policies.profile import resolve_profile
from policies.registry import PolicyContext, default_registry
from policies.routing import Router
from simulator.engine.replica_views import PERFECT_VIEW, RouterSetup
from simulator.engine.runner import PolicyChoice, run
from simulator.engine.workloads import LengthSpec, WorkloadSpec, generate

GUARDED = (PoolLoad, LoadView, Outcome)
"""The values kept to the rule by these tests (`BackendLoad` and `Decision` refuse on their own)."""
POLICIES = ["cost_model", "online", "threshold", "round_robin", "cache_only", "fixed"]
PROFILE = "kimi-k25-int4-8gpu"


def _set_once(self: Any, name: str, value: Any) -> None:
    try:
        getattr(self, name)
    except AttributeError:
        object.__setattr__(self, name, value)
        return
    raise AssertionError(f"{type(self).__name__}.{name} assigned after construction")


@pytest.fixture
def set_once(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for cls in GUARDED:
        monkeypatch.setattr(cls, "__setattr__", _set_once)
    yield


def test_the_guard_catches_a_mutation(set_once: None) -> None:
    o = Outcome(RequestInfo(), Decision("eagle", "e0", "x"), 0.0, 0.1, 10, 1.0, "ok")
    with pytest.raises(AssertionError, match=r"Outcome\.status assigned after construction"):
        o.status = "error"
    p = PoolLoad("eagle")
    with pytest.raises(AssertionError, match=r"PoolLoad\.backends assigned after construction"):
        p.backends = ()


def _backend_load() -> BackendLoad:
    """A `BackendLoad` with no field at its default."""
    return BackendLoad("e0", "eagle", False, 3, 600, 2, 4, 3.1, 0.5, 128, True, 48)


def _decision() -> Decision:
    """A `Decision` with no field at its default."""
    return Decision("eagle", "e0", "faster_eagle", {"eagle": 0.2}, {"eagle": 3.0}, 6, "cost_model", 1.2)


@pytest.mark.parametrize("make", [_backend_load, _decision], ids=["BackendLoad", "Decision"])
def test_assigning_or_deleting_a_field_raises(make: Any) -> None:
    value = make()
    before = copy.copy(value)
    kind = type(value).__name__
    for f in dataclasses.fields(value):
        refused = rf"{kind} is a value: its field '{f.name}'"
        with pytest.raises(dataclasses.FrozenInstanceError, match=refused):
            setattr(value, f.name, getattr(value, f.name))
        with pytest.raises(AttributeError, match="cannot be assigned or deleted"):
            delattr(value, f.name)
    with pytest.raises(AttributeError):
        value.not_a_field = 1
    assert value == before


@pytest.mark.parametrize("make", [_backend_load, _decision], ids=["BackendLoad", "Decision"])
def test_copies_and_variants_are_new_values(make: Any) -> None:
    value = make()
    for twin in (copy.copy(value), copy.deepcopy(value), pickle.loads(pickle.dumps(value))):
        assert twin == value and twin is not value
        # every field, the derived ones too (they do not take part in ==)
        assert [getattr(twin, f.name) for f in dataclasses.fields(twin)] == [
            getattr(value, f.name) for f in dataclasses.fields(value)
        ]


def test_a_variant_rebuilds_the_derived_fields() -> None:
    b = _backend_load()
    assert (b.load, b.admits) == (6, False)
    v = dataclasses.replace(b, full=False, running=10, queued=0)
    assert (v.load, v.admits, v.in_flight) == (10, False, 3)  # usable is still False
    assert dataclasses.replace(v, usable=True).admits
    assert (b.load, b.admits, b.running) == (6, False, 2)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "workload",
    [
        WorkloadSpec(kind="poisson", rate=6.0, requests=400, output_tokens=LengthSpec("exp", 100)),
        WorkloadSpec(kind="multiturn", rate=1.0, requests=200),
        WorkloadSpec(kind="sweep", levels=(2, 40), requests_per_level=30),
    ],
    ids=["poisson", "multiturn", "sweep"],
)
@pytest.mark.parametrize("routers", [PERFECT_VIEW, RouterSetup(2, 1.0)], ids=["one_router", "two_routers"])
def test_the_simulator_and_every_policy_build_values_once(
    set_once: None, policy: str, workload: WorkloadSpec, routers: RouterSetup
) -> None:
    result = run(
        resolve_profile(PROFILE),
        PolicyChoice(policy),
        [("baseline", 2), ("eagle", 1)],
        generate(workload, 1),
        routers=routers,
    )
    assert result.to_json()["summary"]["requests"] > 0


def test_the_proxy_view_and_routing_core_build_values_once(set_once: None) -> None:
    tracker = make_tracker(["b0=http://127.0.0.1:1", "b1=http://127.0.0.1:2"], ["e0=http://127.0.0.1:3"])
    tracker.track_prefixes({"b0": 4096, "b1": 4096, "e0": 4096})
    tracker.set_bounds({"b0": 1, "b1": None, "e0": None}, {"baseline": None, "eagle": None})
    tracker.record_sample("e0", 3, 1, 0.0, 0, 3.1)
    router = Router(0)
    registry = default_registry(entry_points=False)
    context = PolicyContext(resolve_profile(PROFILE))
    for i, policy in enumerate(registry.create(name, {}, context) for name in POLICIES):
        blocks = (1, 2, 3)
        view = tracker.view(1.0, blocks, 2000)
        info = RequestInfo(prompt_tokens=2000, max_tokens=50, forced_pool="eagle" if i == 0 else None)
        decision = router.decide(policy, info, view, 1.0)
        reservation = tracker.reserve(decision.backend, 50, blocks)
        alt = router.failover(tracker.view(1.0), decision.backend, {decision.backend}, False)
        if alt is not None:
            reservation = tracker.move(reservation, alt.name)
        policy.observe(Outcome(info, decision, 1.0, 0.2, 50, 2.0, "ok", failed_over=alt is not None))
        tracker.release(reservation)
    assert tracker.total_in_flight == 0
