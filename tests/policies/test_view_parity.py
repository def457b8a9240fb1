"""The view a policy sees is the same live and simulated: the same facts about the backends go to
the proxy's `LoadTracker` and to a simulated router, and their `LoadView`s agree field by field.

Both build through `policies.view`; these tests hold them to it, including the rules that used
to be written twice: load = max(in-flight, scraped), the staleness of a sample, the replicas
correction, the prefix belief (capped at the prompt estimate) and insert on dispatch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from helpers import make_tracker

from controller.proxy.load import Reservation
from policies.base import BackendLoad, Decision, LoadView, Outcome, RequestInfo
from policies.prefix import DEFAULT_BLOCK_TOKENS, PrefixIndex
from policies.view import STALE_AFTER_S, backend_load, believed_cached, dispatched, true_load
from simulator.engine.replica_views import RouterGroup, Routers, RouterSetup

SERVERS = [("b0", "baseline", None), ("b1", "baseline", None), ("e0", "eagle", 3.2)]
CAPACITY = 8 * DEFAULT_BLOCK_TOKENS


class Idle:
    name = "idle"

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        raise AssertionError("not asked")

    def observe(self, outcome: Outcome) -> None:
        pass


def fields(view: LoadView) -> list[dict[str, Any]]:
    """Every field of every backend, in view order (pool by pool), plus the derived ones."""
    out = []
    for b in view.baseline.backends + view.eagle.backends:
        row = dataclasses.asdict(b)
        row.update(load=b.load, scraped=b.scraped, admits=b.admits, pool_of_view=b.pool)
        out.append(row)
    return out


class Both:
    """The same backends live (a `LoadTracker`) and simulated (one replica router of the engine),
    driven by the same events."""

    def __init__(self, replicas: float) -> None:
        self.live = make_tracker(
            ["b0=http://127.0.0.1:1", "b1=http://127.0.0.1:2"],
            ["e0=http://127.0.0.1:3"],
            stale_after_s=STALE_AFTER_S,
            replicas=replicas,
        )
        self.live.track_prefixes({name: CAPACITY for name, _, _ in SERVERS})
        self.truth = ([0, 0, 0], [0, 0, 0])  # the servers' running / queued at a scrape
        group = RouterGroup(RouterSetup(1, 1.0, "random", replicas), [Idle()])
        self.sim = Routers(group, SERVERS, lambda: self.truth, 0, [0] * 1000)  # type: ignore[arg-type]
        self.indexes = [PrefixIndex(CAPACITY // DEFAULT_BLOCK_TOKENS) for _ in SERVERS]
        # the simulated routers start from a sample of the empty deployment at t = 0: so does the proxy
        # (the simulated servers' accept length is their profile's, as a scrape of SGLang reports it)
        for name, _, accept in SERVERS:
            self.live.record_sample(name, 0, 0, 0.0, 0, accept)
        self.held: dict[int, Reservation] = {}
        self.next_id = 0
        self.budget: dict[int, tuple[int, int]] = {}

    def dispatch(self, server: int, tokens: int, blocks: tuple[int, ...] = ()) -> int:
        """A request goes to `server`: both count it, both indexes learn its prompt."""
        rid = self.next_id
        self.next_id += 1
        self.held[rid] = self.live.reserve(SERVERS[server][0], tokens, blocks)
        self.sim.in_flight[0][server] += 1
        self.sim.tokens[0][server] += tokens
        dispatched(self.indexes[server], blocks)
        self.budget[rid] = (server, tokens)
        return rid

    def finish(self, rid: int) -> None:
        self.live.release(self.held.pop(rid))
        server, tokens = self.budget.pop(rid)
        self.sim.in_flight[0][server] -= 1
        self.sim.tokens[0][server] -= tokens

    def scrape(self, t: float, running: list[int], queued: list[int]) -> None:
        self.truth = (running, queued)
        for i, (name, _, accept) in enumerate(SERVERS):
            in_flight = self.live.get(name).in_flight
            self.live.record_sample(name, running[i], queued[i], t, in_flight, accept)
        self.sim.scrape(0, t)

    def views(
        self, t: float, blocks: tuple[int, ...] = (), prompt: int | None = None
    ) -> tuple[LoadView, LoadView]:
        live = self.live.view(t, blocks, prompt)
        cached = [believed_cached(idx, blocks, prompt) for idx in self.indexes]
        return live, self.sim.view(0, t, cached)


@pytest.mark.parametrize("replicas", [1.0, 3.0])
def test_the_same_facts_give_the_same_view_live_and_simulated(replicas: float) -> None:
    both = Both(replicas)
    system = (11, 12, 13)
    # before any sample: in-flight counts only
    a = both.dispatch(0, 100, (*system, 21))
    both.dispatch(2, 50, system)
    live, sim = both.views(0.5, (*system, 22), 3 * DEFAULT_BLOCK_TOKENS + 10)
    assert fields(live) == fields(sim)
    assert [b.cached_tokens for b in sim.baseline.backends + sim.eagle.backends] == [1536, 0, 1536]
    # a sample, then traffic since it: the correction by this replica's own dispatches and finishes
    both.scrape(1.0, [4, 0, 2], [1, 0, 0])
    both.dispatch(1, 30)
    both.dispatch(1, 30, (*system, 21, 22))
    both.finish(a)
    for t in (1.0, 3.5, 1.0 + STALE_AFTER_S):
        live, sim = both.views(t, (*system, 21, 22, 23), 2000)
        assert fields(live) == fields(sim), t
    stale_live, stale_sim = both.views(1.0 + STALE_AFTER_S + 0.01)
    assert fields(stale_live) == fields(stale_sim)
    assert all(b.running is None for b in stale_sim.baseline.backends + stale_sim.eagle.backends)
    # load is the larger of in-flight and scraped, on both sides
    fresh = both.views(2.0)[1]
    assert [b.load for b in fresh.baseline.backends] == [
        max(b.in_flight, (b.running or 0) + (b.queued or 0)) for b in fresh.baseline.backends
    ]


def test_the_prefix_belief_is_capped_at_the_prompt_estimate_on_both_sides() -> None:
    both = Both(1.0)
    both.dispatch(0, 10, (1, 2, 3))
    live, sim = both.views(0.0, (1, 2, 3), 700)
    assert fields(live) == fields(sim)
    assert live.baseline.backends[0].cached_tokens == 700  # three blocks held, the prompt is shorter


def test_the_perfect_view_is_the_builder_s_fresh_sample() -> None:
    """The simulator's one-router view (`true_load`) is `backend_load` with a sample taken now."""
    for running, queued, tokens in [(0, 0, 0), (5, 0, 900), (48, 7, 12_000)]:
        want = backend_load("e0", "eagle", running + queued, tokens, now=42.0, running=running,
                            queued=queued, sample_time=42.0, accept_length=3.2)  # fmt: skip
        assert true_load("e0", "eagle", running, queued, tokens, 3.2) == want


def test_a_full_backend_is_healthy_but_does_not_admit() -> None:
    tracker = make_tracker(["b0=http://127.0.0.1:1"], ["e0=http://127.0.0.1:2"])
    tracker.set_bounds({"b0": 1, "e0": None}, {"baseline": None, "eagle": None})
    tracker.reserve("b0")
    b0 = tracker.view(0.0).baseline.backends[0]
    assert (b0.usable, b0.full, b0.admits) == (True, True, False)
    assert b0 == backend_load("b0", "baseline", 1, 0, now=0.0, full=True)
    tracker.set_healthy("e0", False)
    tracker.set_healthy("b0", False)
    e0 = tracker.view(0.0).eagle.backends[0]
    assert (e0.usable, e0.full, e0.admits) == (True, False, True)  # panic: every backend usable
    assert isinstance(e0, BackendLoad)


def test_a_backend_whose_facts_did_not_change_keeps_its_value() -> None:
    """`LastLoads` (the proxy's view) hands out a backend's last `BackendLoad` again while nothing
    it was built from changed, and a new one, equal to `backend_load`'s, as soon as a fact did."""
    tracker = make_tracker(["b0=http://127.0.0.1:1"], ["e0=http://127.0.0.1:2"])
    first = tracker.view(1.0)
    again = tracker.view(2.0)  # no sample: `now` changes nothing
    assert again.baseline.backends[0] is first.baseline.backends[0]
    assert again.eagle.backends[0] is first.eagle.backends[0]
    r = tracker.reserve("e0", 64)
    busy = tracker.view(2.0)
    assert busy.baseline.backends[0] is first.baseline.backends[0]
    e0 = busy.eagle.backends[0]
    assert e0 == backend_load("e0", "eagle", 1, 64, now=2.0) and e0 is not first.eagle.backends[0]
    tracker.release(r)
    assert tracker.view(3.0).eagle.backends[0] == first.eagle.backends[0]
    # a sample's age changes with `now`: a new value per view, as `backend_load` makes it
    tracker.record_sample("e0", 3, 1, 2.5, 0, 3.1)
    sampled = [tracker.view(t).eagle.backends[0] for t in (3.0, 3.0, 4.0)]
    assert sampled[1] is sampled[0]  # the same instant
    assert sampled[2] is not sampled[0]
    for got, t in zip(sampled, (3.0, 3.0, 4.0), strict=True):
        want = backend_load("e0", "eagle", 0, 0, now=t, running=3, queued=1, sample_time=2.5,
                            sample_in_flight=0, accept_length=3.1)  # fmt: skip
        assert got == want and got.sample_age_s == want.sample_age_s == t - 2.5
    # a fact the view builder adds (the prefix belief, admission) counts too
    tracker.set_bounds({"b0": 0, "e0": None}, {"baseline": None, "eagle": None})
    b0 = tracker.view(5.0).baseline.backends[0]
    assert (b0.full, b0.admits) == (True, False)
