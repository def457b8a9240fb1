"""The values of `policies.base`: every field is set once, by the constructor, and never assigned
again.

`BackendLoad` and `Decision` refuse an assignment or a deletion themselves
(`dataclasses.FrozenInstanceError`), in the pure Python and in the compiled build
(tests/simulator/test_native.py checks the build); uncompiled, they are built by a `__new__` made
from their written constructor (`policies.values._stores_constructor`), which must build the very
value that constructor does. `PoolLoad`, `LoadView` and `Outcome` are kept
to the rule by these tests: they are made to refuse a second assignment, and the routing core,
every built-in policy, the simulator (one router, several routers, prefix caches, closed and
open loops) and the proxy's view and failover path run through them: any code that changes a
value after building it fails these tests.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import make_tracker

from policies import values
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


def _as_written(cls: type, *args: Any, **kwargs: Any) -> Any:
    """A value of `cls` built by its constructor as written (`object.__setattr__` per field)."""
    value: Any = object.__new__(cls)
    cls.__dict__["__new__"].__func__.__wrapped__(value, *args, **kwargs)
    return value


def _slots(value: Any) -> list[Any]:
    return [getattr(value, f.name) for f in dataclasses.fields(value)]


BUILDS: list[tuple[type, tuple[Any, ...], dict[str, Any]]] = [
    (BackendLoad, ("e0", "eagle"), {}),
    (BackendLoad, ("e0", "eagle", False, 3, 600, 2, 4, 3.1, 0.5, 128, True, 48), {}),
    (BackendLoad, ("b1", "baseline"), {"in_flight": 7, "running": 2, "queued": None, "max_running": 4}),
    (BackendLoad, (), {"name": "b1", "pool": "baseline", "in_flight": 1, "running": 5, "queued": 3}),
    (Decision, ("eagle", "e0", "faster_eagle"), {}),
    (Decision, ("eagle", "e0", "x", {"eagle": 0.2}, {"eagle": 3.0}, 6, "cost_model", 1.2), {}),
    (Decision, ("baseline", "", "y"), {"predicted_e2e_s": {"baseline": 1.0}, "accept_factor": None}),
]


@pytest.mark.parametrize(("cls", "args", "kwargs"), BUILDS)
def test_the_stores_constructor_builds_what_the_written_one_does(
    cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    assert vars(cls)["__init__"] is object.__init__  # uncompiled: built by the stores constructor
    value: Any = cls(*args, **kwargs)
    written = _as_written(cls, *args, **kwargs)
    assert type(value) is cls and value == written
    assert _slots(value) == _slots(written)  # the derived fields too
    assert repr(value) == repr(written)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, next(iter(inspect.signature(cls).parameters)), "changed")


@pytest.mark.parametrize("cls", [BackendLoad, Decision])
def test_the_stores_constructor_keeps_the_signature_and_the_errors(cls: type) -> None:
    written = inspect.signature(cls.__dict__["__new__"].__func__.__wrapped__)
    assert list(inspect.signature(cls).parameters.values()) == list(written.parameters.values())[1:]
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        cls(*(("e0",) if cls is BackendLoad else ("eagle", "e0")))
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        cls("eagle", "e0", "x", nope=1)


def test_a_bad_argument_fails_in_the_written_line() -> None:
    with pytest.raises(TypeError) as caught:
        BackendLoad("e0", "eagle", in_flight=1, running="2", queued=1)  # type: ignore[arg-type]
    lines = [frame.lineno for frame in caught.traceback if frame.path == Path(values.__file__)]
    source = inspect.getsource(values)
    assert any("load_of(in_flight, running, queued)" in source.splitlines()[n] for n in lines)


class _Returns(values._Value):
    __slots__ = ("a",)

    def __init__(self, a: int) -> None:
        object.__setattr__(self, "a", a)
        if a:
            return


def test_a_constructor_that_returns_early_is_refused() -> None:
    with pytest.raises(TypeError, match=r"_Returns\.__init__ returns early"):
        values._stores_constructor(_Returns)


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
