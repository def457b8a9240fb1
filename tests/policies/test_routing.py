"""The routing core (`policies.routing`): its rules by hand, and the proxy and the simulator making
the same decisions for the same inputs."""

from __future__ import annotations

import random
from typing import Any

import aiohttp
import pytest
from helpers import KIMI

from controller.proxy.config import Settings
from controller.proxy.core import build_core
from controller.proxy.errors import NoBackendAvailable, SpecrouteError
from controller.proxy.ticket import Tickets
from policies.base import (
    BackendLoad,
    Decision,
    InvalidDecision,
    LoadView,
    NoHealthyBackend,
    Outcome,
    Pool,
    PoolLoad,
    RequestInfo,
)
from policies.registry import PolicyContext, default_registry
from policies.routing import CLIENT_STALL_SHARE, Router, least_loaded_index, pick_backend, teaches
from simulator.engine.deployment import build_deployment
from simulator.engine.loop import simulate
from simulator.engine.workloads import LengthSpec, WorkloadSpec, generate


class Refuses:
    """A policy that must not be asked (a forced request never reaches the policy)."""

    name = "refuses"

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        raise AssertionError("the policy was asked")

    def observe(self, outcome: Outcome) -> None:
        pass


class Picks:
    """A policy that picks `pool` (and `backend`, if given) every time."""

    def __init__(self, pool: str, backend: str = "") -> None:
        self.name = "picks"
        self.pool, self.backend = pool, backend

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        return Decision(self.pool, self.backend, "picked", policy=self.name)  # type: ignore[arg-type]

    def observe(self, outcome: Outcome) -> None:
        pass


def view(baseline: list[tuple[str, int, bool]], eagle: list[tuple[str, int, bool]]) -> LoadView:
    """Backends as (name, in-flight, healthy) per pool."""

    def pool(name: Pool, backends: list[tuple[str, int, bool]]) -> PoolLoad:
        return PoolLoad(name, tuple(BackendLoad(n, name, usable=ok, in_flight=k) for n, k, ok in backends))

    return LoadView(pool("baseline", baseline), pool("eagle", eagle))


BOTH = view([("b0", 3, True), ("b1", 1, True)], [("e0", 2, True), ("e1", 5, True)])


def test_client_override_goes_to_the_forced_pool_without_asking_the_policy() -> None:
    d = Router(0).decide(Refuses(), RequestInfo(forced_pool="eagle"), BOTH, 0.0)
    assert (d.pool, d.backend, d.reason, d.backend_load, d.policy) == (
        "eagle",
        "e0",
        "client_override",
        2,
        "refuses",
    )
    assert d.predicted_e2e_s == {}  # nobody predicted anything


def test_a_forced_pool_without_a_healthy_backend_fails_instead_of_falling_back() -> None:
    down = view([("b0", 0, True)], [("e0", 0, False)])
    with pytest.raises(NoHealthyBackend, match="pool 'eagle' has no healthy backend"):
        Router(0).decide(Refuses(), RequestInfo(forced_pool="eagle"), down, 0.0)


def test_fallback_to_the_other_pool_when_the_chosen_one_has_no_healthy_backend() -> None:
    down = view([("b0", 7, True)], [("e0", 0, False)])
    d = Router(0).decide(Picks("eagle"), RequestInfo(), down, 0.0)
    assert (d.pool, d.backend, d.reason, d.backend_load) == ("baseline", "b0", "eagle_unavailable", 7)
    # a named backend that is down falls back the same way
    d = Router(0).decide(Picks("eagle", "e0"), RequestInfo(), down, 0.0)
    assert (d.pool, d.backend, d.reason) == ("baseline", "b0", "eagle_unavailable")
    with pytest.raises(NoHealthyBackend, match="no healthy backend in either pool"):
        Router(0).decide(Picks("baseline"), RequestInfo(), view([("b0", 0, False)], [("e0", 0, False)]), 0.0)


def test_backend_within_a_pool_least_load_with_a_seeded_tie_break() -> None:
    d = Router(0).decide(Picks("baseline"), RequestInfo(), BOTH, 0.0)
    assert (d.backend, d.backend_load) == ("b1", 1)
    # the load is the larger of local in-flight and scraped running + queued; unhealthy is skipped
    scraped = LoadView(
        PoolLoad(
            "baseline",
            (
                BackendLoad("b0", "baseline", in_flight=0, running=6, queued=1),
                BackendLoad("b1", "baseline", in_flight=2),
                BackendLoad("b2", "baseline", in_flight=0, usable=False),
            ),
        ),
        PoolLoad("eagle", ()),
    )
    assert Router(0).decide(Picks("baseline"), RequestInfo(), scraped, 0.0).backend == "b1"
    tied = view([("b0", 2, True), ("b1", 2, True), ("b2", 2, True), ("b3", 9, True)], [])

    def picks(seed: int) -> list[str]:
        router = Router(seed)
        return [router.decide(Picks("baseline"), RequestInfo(), tied, 0.0).backend for _ in range(300)]

    first = picks(1)
    assert first == picks(1) and first != picks(2)  # reproducible per seed
    counts = {n: first.count(n) for n in ("b0", "b1", "b2", "b3")}
    assert counts["b3"] == 0 and all(counts[n] > 60 for n in ("b0", "b1", "b2")), counts
    # the rule on plain numbers draws from the rng only on a tie
    rng = random.Random(5)
    state = rng.getstate()
    assert least_loaded_index([4, 1, 3], rng) == 1 and rng.getstate() == state
    assert pick_backend(PoolLoad("eagle", ()), rng) is None


def test_a_policy_naming_a_healthy_backend_keeps_it_and_an_unknown_one_is_invalid() -> None:
    d = Router(0).decide(Picks("baseline", "b0"), RequestInfo(), BOTH, 0.0)
    assert (d.pool, d.backend, d.backend_load) == ("baseline", "b0", 3)  # not the least loaded, but named
    with pytest.raises(InvalidDecision, match="'e0', which is not in the baseline pool"):
        Router(0).decide(Picks("baseline", "e0"), RequestInfo(), BOTH, 0.0)
    with pytest.raises(InvalidDecision, match="chose pool 'turbo'"):
        Router(0).decide(Picks("turbo"), RequestInfo(), BOTH, 0.0)


def test_failover_same_pool_first_then_the_other_unless_forced() -> None:
    router = Router(0)
    v = view([("b0", 0, True), ("b1", 4, True)], [("e0", 1, False), ("e1", 9, True)])
    assert router.failover(v, "b0", {"b0"}, forced=False).name == "b1"  # type: ignore[union-attr]
    assert router.failover(v, "b1", {"b0", "b1"}, forced=False).name == "e1"  # type: ignore[union-attr]
    assert router.failover(v, "b1", {"b0", "b1"}, forced=True) is None
    assert router.failover(v, "e1", {"e1"}, forced=True) is None  # e0 is unhealthy
    with pytest.raises(InvalidDecision):
        router.failover(v, "nope", set(), forced=False)


def _tickets(policy: object, seed: int) -> Tickets:
    """The proxy's request path; its `decide` decides on the `LoadView` it is given (the backends'
    names come from the view, so any view can be replayed)."""
    settings = Settings.model_validate(
        {"baseline": ["http://b0:1"], "eagle": ["http://e0:1"], "policy": "fixed", "seed": seed}
    )
    return build_core(settings, policy, clock=lambda: 0.0, shadows=()).tickets  # type: ignore[arg-type]


def test_the_proxy_decides_exactly_as_the_core_including_its_errors() -> None:
    names = (["http://b0:1", "http://b1:1"], ["http://e0:1", "http://e1:1"])
    rng = random.Random(3)
    registry = default_registry(entry_points=False)
    proxy_policy = registry.create("online", {"epsilon": 0.3}, PolicyContext(KIMI, 4))
    core_policy = registry.create("online", {"epsilon": 0.3}, PolicyContext(KIMI, 4))
    fwd, core = _tickets(proxy_policy, 9), Router(9)
    outcomes = 0
    for i in range(400):
        pool_names: tuple[Pool, Pool] = ("baseline", "eagle")
        pools = [
            PoolLoad(
                p, tuple(BackendLoad(u, p, usable=rng.random() > 0.2, in_flight=rng.randrange(4)) for u in us)
            )
            for p, us in zip(pool_names, names, strict=True)
        ]
        v = LoadView(pools[0], pools[1])
        forced: Pool | None = rng.choice([None, None, None, "baseline", "eagle"])  # type: ignore[assignment]
        info = RequestInfo(
            max_tokens=rng.randrange(1, 400), hint=rng.choice([None, "code"]), forced_pool=forced
        )
        try:
            expected = core.decide(core_policy, info, v, float(i))
        except NoHealthyBackend as e:
            with pytest.raises(NoBackendAvailable) as caught:
                fwd.decide(proxy_policy, info, v, float(i))
            assert str(e) in caught.value.message
            continue
        got = fwd.decide(proxy_policy, info, v, float(i))
        assert got == expected
        outcome = Outcome(info, got, float(i), 0.1, info.max_tokens, 0.1 + info.max_tokens / 50.0, "ok")  # type: ignore[operator]
        proxy_policy.observe(outcome)
        core_policy.observe(outcome)
        outcomes += 1
    assert outcomes > 200


def test_a_policy_that_fails_is_a_500_in_the_proxy_and_an_invalid_choice_is_named() -> None:
    class Broken(Refuses):
        def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
            raise RuntimeError("bug")

    fwd = _tickets(Broken(), 0)
    v = view([("http://b0:1", 0, True)], [("http://e0:1", 0, True)])
    with pytest.raises(SpecrouteError, match="routing policy 'refuses' failed"):
        fwd.decide(fwd.policy, RequestInfo(), v, 0.0)
    with pytest.raises(SpecrouteError, match="chose backend 'x'"):
        fwd.decide(Picks("eagle", "x"), RequestInfo(), v, 0.0)  # type: ignore[arg-type]


class Recording:
    """Wraps a policy and records every call the simulator makes, in order."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[attr-defined]
        self.calls: list[tuple[str, Any]] = []

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        d = self.inner.choose(request, view, now)  # type: ignore[attr-defined]
        self.calls.append(("choose", (request, view, now)))
        return d

    def observe(self, outcome: Outcome) -> None:
        self.calls.append(("observe", outcome))
        self.inner.observe(outcome)  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", ["online", "cost_model", "threshold"])
def test_the_simulator_and_the_proxy_route_the_same_inputs_identically(policy: str) -> None:
    """A simulated run's inputs replayed through the proxy's request path give its decisions."""
    registry = default_registry(entry_points=False)
    params = {"epsilon": 0.2} if policy == "online" else {}
    recorder = Recording(registry.create(policy, params, PolicyContext(KIMI, 7)))
    servers = build_deployment(KIMI, (("baseline", 2), ("eagle", 2)))
    spec = WorkloadSpec(kind="poisson", rate=6.0, requests=600, output_tokens=LengthSpec("exp", 150))
    raw = simulate(servers, recorder, generate(spec, 1)[0].batch, seed=11)
    simulated = [servers[i].name for i in raw.server]

    fwd = _tickets(registry.create(policy, params, PolicyContext(KIMI, 7)), 11)
    replayed: list[str] = []
    for kind, call in recorder.calls:
        if kind == "choose":
            request, v, now = call
            replayed.append(fwd.decide(fwd.policy, request, v, now).backend)
        else:
            fwd.policy.observe(call)
    assert replayed == simulated  # the same backend for every request, tie-breaks included
    assert len(set(simulated)) == 4


async def test_a_forced_pool_that_is_down_is_a_503_through_the_proxy(fake_backend, proxy) -> None:  # type: ignore[no-untyped-def]
    base = await fake_backend()
    p = await proxy(
        baseline=[base.url],
        eagle=["http://127.0.0.1:9"],
        policy="fixed",
        policy_params={"pool": "eagle"},
        health_checks=False,
        allow_client_override=True,
    )
    p.tracker.set_healthy("http://127.0.0.1:9", False)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(
            p.url + "/v1/chat/completions", json=body, headers={"x-specroute-mode": "eagle"}
        ) as r:
            assert r.status == 503
            assert "pool 'eagle' has no healthy backend" in (await r.json())["error"]["message"]
        async with s.post(p.url + "/v1/chat/completions", json=body) as r:  # unforced: falls back
            assert r.status == 200
            assert (r.headers["x-specroute-pool"], r.headers["x-specroute-reason"]) == (
                "baseline",
                "eagle_unavailable",
            )
    assert len(base.requests) == 1  # the forced request reached no backend


class Names:
    """A policy that names eagle's backend with a given `backend_load`."""

    name = "names"

    def __init__(self, load: int) -> None:
        self.load = load
        self.made: list[Decision] = []

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        d = Decision("eagle", "e1", "named", {"eagle": 1.0}, {"eagle": 2.0}, self.load, self.name)
        self.made.append(d)
        return d

    def observe(self, outcome: object) -> None:
        pass


def test_a_decision_named_with_its_backends_load_is_returned_as_it_is() -> None:
    e0 = BackendLoad("e0", "eagle", in_flight=1)
    e1 = BackendLoad("e1", "eagle", running=3, queued=2, in_flight=4)  # load: 5
    v = LoadView(PoolLoad("baseline", (BackendLoad("b0", "baseline"),)), PoolLoad("eagle", (e0, e1)))
    right = Names(5)
    d = Router(0).decide(right, RequestInfo(), v, 0.0)
    assert d is right.made[0]
    wrong = Names(0)  # a policy's wrong load is never passed on: the core completes a new value
    d = Router(0).decide(wrong, RequestInfo(), v, 0.0)
    assert d is not wrong.made[0] and wrong.made[0].backend_load == 0
    assert (d.pool, d.backend, d.reason, d.backend_load, d.predicted_e2e_s) == (
        "eagle",
        "e1",
        "named",
        5,
        {"eagle": 2.0},
    )
    full = LoadView(v.baseline, PoolLoad("eagle", (e0, BackendLoad("e1", "eagle", in_flight=5, full=True))))
    d = Router(0).decide(Names(5), RequestInfo(), full, 0.0)  # named but full: rule 3 picks e0
    assert (d.backend, d.backend_load) == ("e0", 1)


def test_an_outcome_whose_client_held_the_relay_up_teaches_nothing() -> None:
    """Rule 6 (issue 37, finding 1): the backend goes on generating while the relay waits on a slow
    client, so an outcome whose relay waited on its client for more than CLIENT_STALL_SHARE of
    its duration says nothing of the backend's speed; below it, the decode rate leaves that
    time out."""

    def outcome(blocked: float) -> Outcome:
        return Outcome(RequestInfo(), Decision("eagle", "e0", "faster_eagle"), 0.0, 0.5, 101, 10.5, "ok",
                       client_blocked_s=blocked)  # fmt: skip

    assert teaches(outcome(0.0)) and outcome(0.0).decode_tok_s == pytest.approx(10.0)
    within = outcome(CLIENT_STALL_SHARE * 10.5)
    assert teaches(within) and within.decode_tok_s == pytest.approx(100 / (10.0 - CLIENT_STALL_SHARE * 10.5))
    assert not teaches(outcome(CLIENT_STALL_SHARE * 10.5 + 0.01))
    assert not teaches(outcome(9.0))  # the probe's: most of its time waiting on the client
