"""Several simulated specroute replicas (`--routers`), each with its own scraped view."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from helpers import make_tracker, run_main

from policies.base import Decision, LoadView, Outcome, RequestInfo
from policies.profile import resolve_profile
from policies.replicas import believed_counts
from policies.routing import pool_decision
from policies.view import backend_load
from simulator.engine.deployment import build_deployment, parse_deployment
from simulator.engine.loop import RequestBatch, simulate
from simulator.engine.replica_views import RouterGroup, RouterSetup
from simulator.engine.runner import PolicyChoice, run
from simulator.engine.workloads import LengthSpec, WorkloadSpec, generate

PROFILE = "kimi-k25-int4-8gpu"


class AlwaysEagle:
    """Sends everything to eagle and records the eagle load each decision saw, and its outcomes."""

    name = "always_eagle"

    def __init__(self) -> None:
        self.seen: list[tuple[float, int]] = []
        self.outcomes = 0

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        self.seen.append((now, view.eagle.backends[0].load))
        return pool_decision("eagle", "test", policy=self.name)

    def observe(self, outcome: Outcome) -> None:
        self.outcomes += 1


def long_batch(n: int, gap: float) -> RequestBatch:
    """`n` requests `gap` s apart, each far longer than the run's arrivals (none finishes early)."""
    return RequestBatch(
        [16] * n, [5000] * n, [5000] * n, [None] * n, [1.0] * n, [gap * (i + 1) for i in range(n)]
    )


def seen_loads(routers: int, interval: float, replicas: float = 1.0) -> list[list[int]]:
    profile = resolve_profile(PROFILE)
    servers = build_deployment(profile, parse_deployment("baseline=1,eagle=1"))
    policies = [AlwaysEagle() for _ in range(routers)]
    group = RouterGroup(RouterSetup(routers, interval, "round-robin", replicas), policies)
    simulate(servers, None, long_batch(8, 0.01), routers=group)
    assert sum(len(p.seen) for p in policies) == 8
    return [[load for _, load in p.seen] for p in policies]


def test_each_router_sees_its_own_dispatches_not_the_others_until_it_scrapes() -> None:
    # round-robin over 2 routers, no scrape within the run (interval 100 s): each router sees
    # only its own requests on eagle, 0, 1, 2, 3 ...
    assert seen_loads(2, 100.0) == [[0, 1, 2, 3], [0, 1, 2, 3]]
    # ... while one router with the perfect view sees every request, 0 .. 7
    assert seen_loads(1, 0.0) == [list(range(8))]
    # two routers that see the true load at every decision see each other's requests
    assert seen_loads(2, 0.0) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # the replicas setting: each router counts its own traffic since the sample twice
    assert seen_loads(2, 100.0, replicas=2.0) == [[0, 2, 4, 6], [0, 2, 4, 6]]


def test_a_scrape_shows_the_others_requests() -> None:
    # arrivals every 0.01 s, scrapes every 0.025 s: after a scrape a router sees the true
    # count, then adds its own dispatches until the next one, so it never sees more than the
    # truth and sometimes less
    loads = seen_loads(2, 0.025)
    truth = [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert all(
        s <= t for mine, true in zip(loads, truth, strict=True) for s, t in zip(mine, true, strict=True)
    )
    assert loads != [[0, 1, 2, 3], [0, 1, 2, 3]]  # some scrape was seen
    assert loads != truth  # and some view was stale


def test_every_router_learns_from_its_own_outcomes_only() -> None:
    profile = resolve_profile(PROFILE)
    servers = build_deployment(profile, parse_deployment("baseline=1,eagle=1"))
    policies = [AlwaysEagle() for _ in range(3)]
    batch = RequestBatch([16] * 30, [5] * 30, [5] * 30, [None] * 30, [1.0] * 30, [0.5 * i for i in range(30)])
    simulate(servers, None, batch, routers=RouterGroup(RouterSetup(3, 1.0, "round-robin"), policies))
    assert [p.outcomes for p in policies] == [10, 10, 10]
    assert [len(p.seen) for p in policies] == [10, 10, 10]


def test_the_proxy_and_the_simulator_combine_a_sample_the_same_way() -> None:
    tracker = make_tracker(["b=http://127.0.0.1:1"], ["e=http://127.0.0.1:2"], stale_after_s=5.0, replicas=3)
    for _ in range(4):
        tracker.reserve("e")
    tracker.record_sample("e", running=10, queued=2, taken_at=100.0, in_flight_at_sample=1)
    got = tracker.view(101.0).eagle.backends[0]
    want = backend_load(
        "e", "eagle", 4, 0, running=10, queued=2, sample_time=100.0, sample_in_flight=1,
        accept_length=None, now=101.0, stale_after_s=5.0, replicas=3,
    )  # fmt: skip
    assert got == want
    assert (got.running, got.queued) == (19, 2)  # 10 + 3 x (4 - 1) running, 2 queued
    assert believed_counts(10, 2, 4, 1) == (13, 2)  # without the setting: 10 + 3
    assert believed_counts(3, 2, 0, 4) == (0, 1)  # 4 of ours finished since: 5 - 4 left, queue first
    assert tracker.view(106.5).eagle.backends[0].running is None  # stale: own counts only


def poisson_run(routers: RouterSetup, *, rate: float = 6.0, n: int = 1500) -> dict[str, Any]:
    profile = resolve_profile(PROFILE)
    spec = WorkloadSpec(kind="poisson", rate=rate, requests=n, output_tokens=LengthSpec("exp", 200))
    result = run(
        profile,
        PolicyChoice("cost_model"),
        [("baseline", 1), ("eagle", 1)],
        generate(spec, 3),
        routers=routers,
    )
    return result.to_json()


def test_views_disagree_with_several_routers_and_never_with_one() -> None:
    one = poisson_run(RouterSetup(1, 1.0))["routers"]
    assert one["view_disagreement"] == 0.0 and one["decisions"] == 1500
    live = poisson_run(RouterSetup(4, 0.0))["routers"]
    assert live["view_disagreement"] == 0.0 and live["view_error"] == 0.0
    stale = poisson_run(RouterSetup(4, 1.0))["routers"]
    assert 0.0 < stale["view_disagreement"] <= 1.0 and stale["view_error"] > 0.0
    assert sum(stale["decisions_per_router"]) == 1500 and min(stale["decisions_per_router"]) > 0
    staler = poisson_run(RouterSetup(4, 5.0))["routers"]
    assert staler["view_error"] > stale["view_error"]


def test_several_routers_are_deterministic_to_the_bit() -> None:
    a = poisson_run(RouterSetup(8, 0.5, "random", 4.0), n=800)
    b = poisson_run(RouterSetup(8, 0.5, "random", 4.0), n=800)
    assert json.dumps(a) == json.dumps(b)
    c = poisson_run(RouterSetup(8, 0.5, "round-robin", 4.0), n=800)
    assert c["routers"]["decisions_per_router"] == [100] * 8
    assert c["summary"] != a["summary"]


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    return run_main(capsys, "simulate", "--profile", PROFILE, *args)


def test_the_default_is_one_router_with_the_perfect_view(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--policy", "cost_model", "--workload", "poisson", "--rate", "6", "--requests", "600", "--json"]
    code, default, err = cli(capsys, *common)
    assert code == 0, err
    code, explicit, err = cli(capsys, *common, "--routers", "1", "--scrape-interval", "0")
    assert code == 0, err
    assert default == explicit and "routers" not in json.loads(default)["runs"][0]
    code, out, err = cli(capsys, *common, "--routers", "4")
    assert code == 0, err
    views = json.loads(out)["runs"][0]["routers"]
    assert (views["routers"], views["scrape_interval_s"], views["split"]) == (4, 1.0, "random")


def test_the_table_shows_routers_and_disagreement(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(
        capsys, "--policy", "cost_model", "--workload", "poisson", "--rate", "6", "--requests", "300",
        "--routers", "3", "--scrape-interval", "2", "--router-split", "round-robin",
    )  # fmt: skip
    assert code == 0, err
    header, row = out.splitlines()[1:3]
    assert header.split()[-4:] == ["routers", "views", "differ", "%"]
    assert row.split()[-5:-1] == ["3", "x", "2", "s"]
    assert 0.0 < float(row.split()[-1]) <= 100.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--routers", "0"], "--routers"),
        (["--scrape-interval", "-1"], "--scrape-interval"),
        (["--router-split", "sticky"], "--router-split"),
        (["--replicas-setting", "0"], "--replicas-setting"),
    ],
)
def test_bad_router_flags_are_a_clear_error(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "controller.cli", "simulate", "--profile", PROFILE, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
