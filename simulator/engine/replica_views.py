"""Several specroute replicas ("routers") in front of the same simulated servers, each with its
own, stale view of their load.

How it works: arrivals are split across `routers` routers, at random or round-robin (as a
Kubernetes Service's kube-proxy does: iptables mode picks at random, IPVS round-robin). Each
router has its own policy instance and its own `policies.routing.Router`, all with the same seed
(replicas of one Deployment share their configuration). A router sees each backend as the
live proxy does (`policies.view.backend_load`, the very builder `controller.proxy.load`
uses): the server's true running/queued counts as of its last scrape, plus the requests this
router dispatched and saw finish since. Router r scrapes every `scrape_interval_s`, first at
its own phase in (0, S] (seeded), after an initial sample of the empty deployment at t = 0.
A scrape reads the true counts at that instant (SGLang's own refresh lag is not modelled).
With `scrape_interval_s` 0 every router sees the true load at every decision.

Each router learns only from the outcomes of the requests it routed, as a live replica does.

View disagreement, reported per run: at each decision, the deciding router's view of every
backend's load (`BackendLoad.load`: the larger of its own in-flight count and the believed
running + queued) is compared with the view each other router would have at that instant;
`view_disagreement` is the fraction of those (deciding router, other router) pairs, over all
decisions, that differ on at least one backend: how often two routers, asked at the same
instant, would see different loads. `view_error` is the mean, over decisions, of the summed
absolute difference between the deciding router's believed load and each backend's true load.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from policies.base import (
    BackendLoad,
    Decision,
    LoadView,
    Outcome,
    Policy,
    Pool,
    PoolLoad,
    RequestInfo,
    load_of,
)
from policies.replicas import believed_counts
from policies.routing import Router
from policies.view import STALE_AFTER_S, backend_load

Split = Literal["random", "round-robin"]
SPLITS: tuple[Split, ...] = ("random", "round-robin")


@dataclass(frozen=True)
class RouterSetup:
    """How many routers, how they scrape, how arrivals are split among them."""

    routers: int = 1
    scrape_interval_s: float = 1.0
    """Seconds between a router's scrapes; 0: every router sees the true load at every decision."""
    split: Split = "random"
    replicas: float = 1.0
    """The `replicas` setting each router is given (`policies.replicas.believed_counts`)."""
    stale_after_s: float = STALE_AFTER_S

    def __post_init__(self) -> None:
        if self.routers < 1:
            raise ValueError("routers must be >= 1")
        if self.scrape_interval_s < 0:
            raise ValueError("the scrape interval must be >= 0")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}")
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")

    @property
    def perfect(self) -> bool:
        """One router that sees the true load at every decision (the engine's own fast path)."""
        return self.routers == 1 and self.scrape_interval_s == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "routers": self.routers,
            "scrape_interval_s": self.scrape_interval_s,
            "split": self.split,
            "replicas_setting": self.replicas,
        }


PERFECT_VIEW = RouterSetup(1, 0.0)


@dataclass
class ViewStats:
    """Views' agreement over a run's decisions (all segments)."""

    decisions: int = 0
    pairs: int = 0
    disagreements: int = 0
    """Of `pairs` (deciding router, other router) compared, those whose views differed."""
    error_sum: int = 0
    per_router: list[int] = field(default_factory=list)
    """Decisions per router."""

    def to_json(self) -> dict[str, Any]:
        d = self.decisions
        return {
            "decisions": d,
            "view_disagreement": self.disagreements / self.pairs if self.pairs else (0.0 if d else None),
            "view_error": self.error_sum / d if d else None,
            "decisions_per_router": list(self.per_router),
        }


@dataclass
class RouterGroup:
    """The routers of one run: their setup, policies (one per router, living across segments)
    and the run's view statistics."""

    setup: RouterSetup
    policies: Sequence[Policy]
    stats: ViewStats = field(default_factory=ViewStats)

    def __post_init__(self) -> None:
        if len(self.policies) != self.setup.routers:
            raise ValueError("one policy per router")
        if not self.stats.per_router:
            self.stats.per_router = [0] * self.setup.routers


class Routers:
    """The routers during one segment (simulated from an empty deployment).

    The engine calls `decide` on an arrival, `scrape` on a router's scrape event and `finished`
    on a completion; `counts()` gives the servers' true (running, queued) lists."""

    def __init__(
        self,
        group: RouterGroup,
        servers: Sequence[tuple[str, Pool, float | None]],
        counts: Callable[[], tuple[list[int], list[int]]],
        seed: int,
        budget: Sequence[int],
    ) -> None:
        setup = group.setup
        self.group = group
        self.setup = setup
        self.policies = group.policies
        self.stats = group.stats
        self.servers = servers
        self.counts = counts
        self.budget = budget
        n, r = len(servers), setup.routers
        self.n = r
        self.index = {name: i for i, (name, _, _) in enumerate(servers)}
        self.routers = [Router(seed) for _ in range(r)]
        self.in_flight = [[0] * n for _ in range(r)]
        self.tokens = [[0] * n for _ in range(r)]
        self.s_running = [[0] * n for _ in range(r)]
        self.s_queued = [[0] * n for _ in range(r)]
        self.s_in_flight = [[0] * n for _ in range(r)]
        self.s_time = [0.0] * r
        self.owner: dict[int, int] = {}
        rng = random.Random(f"routers/{seed}")
        self.rng = rng
        interval = setup.scrape_interval_s
        self.phases = [interval - rng.random() * interval for _ in range(r)] if interval > 0 else []
        self.next_router = 0
        self.live = setup.scrape_interval_s == 0

    def first_scrapes(self) -> list[float]:
        """The time of each router's first scrape (none when every view is live)."""
        return list(self.phases)

    def scrape(self, r: int, t: float) -> None:
        """Router `r` takes a sample of every server at `t`."""
        running, queued = self.counts()
        self.s_running[r] = running
        self.s_queued[r] = queued
        self.s_in_flight[r] = list(self.in_flight[r])
        self.s_time[r] = t

    def _believed(self, r: int, i: int, t: float) -> int:
        """Router `r`'s view of server `i`'s load (`BackendLoad.load`) at `t`."""
        own = self.in_flight[r][i]
        if t - self.s_time[r] > self.setup.stale_after_s:
            return own
        running, queued = believed_counts(
            self.s_running[r][i], self.s_queued[r][i], own, self.s_in_flight[r][i], self.setup.replicas
        )
        return load_of(own, running, queued)

    def view(self, r: int, t: float, cached: Sequence[int] | None = None) -> LoadView:
        """Router `r`'s `LoadView` at `t`; `cached`: per server, the tokens of this request's
        prompt the router believes it holds."""
        base: list[BackendLoad] = []
        eagle: list[BackendLoad] = []
        setup = self.setup
        for i, (name, pool, accept) in enumerate(self.servers):
            bl = backend_load(
                name,
                pool,
                self.in_flight[r][i],
                self.tokens[r][i],
                running=self.s_running[r][i],
                queued=self.s_queued[r][i],
                sample_time=self.s_time[r],
                sample_in_flight=self.s_in_flight[r][i],
                accept_length=accept,
                now=t,
                stale_after_s=setup.stale_after_s,
                replicas=setup.replicas,
                cached_tokens=0 if cached is None else cached[i],
            )
            (base if pool == "baseline" else eagle).append(bl)
        return LoadView(PoolLoad("baseline", tuple(base)), PoolLoad("eagle", tuple(eagle)))

    def _pick_router(self) -> int:
        if self.n == 1:
            return 0
        if self.setup.split == "random":
            return self.rng.randrange(self.n)
        r = self.next_router
        self.next_router = (r + 1) % self.n
        return r

    def decide(
        self,
        a: int,
        info: RequestInfo,
        t: float,
        believe: Callable[[int], Sequence[int]] | None = None,
    ) -> Decision:
        """Route request `a` through one router; records it as that router's dispatch.
        `believe(r)` gives, per server, the tokens of this request's prompt router `r`'s prefix
        index believes it holds (`BackendLoad.cached_tokens`)."""
        r = self._pick_router()
        if self.live:
            self.scrape(r, t)
        view = self.view(r, t, None if believe is None else believe(r))
        self._account(r, view, t)
        decision = self.routers[r].decide(self.policies[r], info, view, t)
        i = self.index[decision.backend]
        self.in_flight[r][i] += 1
        self.tokens[r][i] += self.budget[a]
        self.owner[a] = r
        return decision

    def _account(self, r: int, view: LoadView, t: float) -> None:
        stats = self.stats
        stats.decisions += 1
        stats.per_router[r] += 1
        mine = [b.load for b in view.baseline.backends] + [b.load for b in view.eagle.backends]
        order = [i for i, s in enumerate(self.servers) if s[1] == "baseline"]
        order += [i for i, s in enumerate(self.servers) if s[1] == "eagle"]
        running, queued = self.counts()
        stats.error_sum += sum(abs(m - running[i] - queued[i]) for m, i in zip(mine, order, strict=True))
        if self.live or self.n == 1:
            return
        stats.pairs += self.n - 1
        for q in range(self.n):
            if q != r and any(self._believed(q, i, t) != m for m, i in zip(mine, order, strict=True)):
                stats.disagreements += 1

    def finished(self, a: int, i: int, outcome: Outcome | None) -> None:
        """Request `a` finished on server `i`: its router's in-flight count drops (and its policy
        learns the outcome, when there is one)."""
        r = self.owner.pop(a)
        self.in_flight[r][i] -= 1
        self.tokens[r][i] -= self.budget[a]
        if outcome is not None:
            self.policies[r].observe(outcome)
