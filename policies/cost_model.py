"""`cost_model`: send each request where it costs the whole system least, by the speed profile.

How it works: for each pool take its least-loaded healthy backend (backend-reported running
and queued requests when a fresh sample exists, else this proxy's in-flight count as running)
and ask the speed profile what the request would cost there (`SpeedModel.predict_system_s`):

- `scope=system` (the default) compares marginal costs: the request's own end-to-end time plus
  the time it adds to the requests it slows down -- exactly, the seconds per request at the
  margin of the pool's completion rate, so the pool chosen is the one whose total rate grows
  most. The requests it slows are those expected to share its life (`count_arrivals`, on by
  default): the ones present leave part way through it and the ones arriving during it join part
  way, at the pool's arrival rate (per backend) and with the mean predicted e2e of the requests
  this policy sent there in its last `arrival_window` decisions (their times are `now`:
  deterministic in the simulator). A short request shares the batch it finds, a long one the
  pool's mean occupancy; an idle pool that receives requests is not free for a request that
  would hold it long. A request
  that would wait in a full pool's queue adds nothing there (a queued request produces nothing):
  its cost is infinite while the other pool still gains from one more request. When neither
  gains, the request goes where it finishes sooner. A pool is full at the backend's own
  running-request cap when it reports one (`BackendLoad.max_running`), else at the profile's
  `max_running_requests`.
- `scope=request` is the selfish rule: the pool that finishes this request sooner.

`objective=ttft` compares times to first token instead (system scope: never a queue while the
other pool has a free slot). With `slo_ttft_s` / `slo_tpot_s`, a pool predicted to miss an SLO
is not chosen while the other is predicted to meet it.

Calibration (`calibrate`, on by default): the profile is a prior. Every outcome of a request
this policy routed teaches `policies.calibration.SpeedCalibration` how far the pool's real
decode rate is from the profile's at that load, and (eagle) how a hint's acceptance differs;
predictions use the corrected speeds. `hint_speedup` factors are priors for the hints named,
over the profile's measured `categories` (which `specroute bench --prompts` writes).

Content (`content_aware`, on by default): a request with content features (`RequestInfo.features`)
gets its own eagle speed factor, predicted by `policies.content.ContentAcceptance` from what it
asks and learned from outcomes; it replaces the hint's factor (the hint stays one of its features).
The predictions for both pools go into the `Decision`, so predicted-vs-actual can be measured.
A content prediction carries its uncertainty, and `policies.explore` sometimes tries EAGLE for a
request predicted cheaper on the plain pool (reason `explore`), within `explore_budget`.

The reason names what decided: `faster_<pool>` when the chosen pool's predicted e2e (TTFT for
`objective=ttft`) is the smaller, `cheaper_<pool>` when system scope chose the pool whose marginal
cost is smaller although this request alone would finish sooner on the other, `eagle_margin`
when EAGLE was predicted cheaper but not by `eagle_margin`, `slo_<pool>`, `explore`, or the
routing core's `<pool>_unavailable`.

Prefix caches (`prefix_aware`, on by default): a backend's prediction counts only the prefill of
the prompt tokens it does not hold (`BackendLoad.cached_tokens`, from the prefix index), at the
profile's `prefill_tok_s`. Prefill is compute-bound and a server prefills one batch at a time,
so the prediction also counts the prefill this policy sent there that has not drained yet (its
own estimate from `now`: exact for one proxy replica, a lower bound with several), as this
request's wait, and in system scope the time its own prefill adds to the requests that will
queue behind it (as many as it finds ahead). Every healthy backend of a pool is predicted and
the cheapest named (`policies.routing.cheapest_backend`), so a long context goes where it is
cached unless the load there costs more than the prefill it saves: the balance comes out of the
same prediction, no threshold. A profile without `prefill_tok_s` has TTFTs that include a
typical prompt's prefill: cached tokens are then credited at this policy's `prefill_tok_s`
(default 10,000 tok/s), and backends are compared only when one holds part of the prompt.
`prefix_aware=false` ignores `cached_tokens` and queued prefill (the cache-blind behaviour: the
least-loaded backend of each pool).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Mapping
from typing import Any

from policies.base import BackendLoad, Decision, LoadView, Outcome, Pool, PoolLoad, RequestInfo
from policies.calibration import SpeedCalibration
from policies.content import ContentAcceptance
from policies.cost_model_params import DEFAULT_BUCKETS as DEFAULT_BUCKETS
from policies.cost_model_params import DEFAULT_PREFILL_TOK_S as DEFAULT_PREFILL_TOK_S
from policies.cost_model_params import CostModelParams as CostModelParams
from policies.cost_model_params import Objective as Objective
from policies.cost_model_params import Scope as Scope
from policies.explore import Explorer
from policies.learned import Learner, StateError, check_version, field
from policies.profile import TABLE_SIZE as _TABLE_SIZE
from policies.profile import SpeedModel
from policies.routing import cheapest_backend, fallback, first_least_loaded, teaches
from policies.spec import PolicyContext, PolicyError, PolicySpec

Prediction = tuple[float, float, float, bool, float, int, float | None]
"""(TTFT, end-to-end, marginal cost, would queue, time per output token, its load, its own prefill
seconds when the profile gives the pool's prefill rate and the policy is prefix-aware, else None)
on one backend."""


class CostModelPolicy:
    name = "cost_model"

    def __init__(self, params: CostModelParams, context: PolicyContext) -> None:
        if context.profile is None:
            raise PolicyError("policy 'cost_model' needs a speed profile (--profile FILE)")
        missing = [m for m in ("baseline", "eagle") if m not in context.profile.modes]
        if missing:
            raise PolicyError(f"policy 'cost_model': the profile has no {' or '.join(missing)} mode")
        self.params = params
        self._baseline: SpeedModel = context.profile.belief("baseline")  # its throughput concave
        self._eagle: SpeedModel = context.profile.belief("eagle")
        self._profile_accept = self._eagle.accept_length
        self._mean_n = (
            params.mean_output_tokens
            if params.mean_output_tokens is not None
            else float(params.default_output_tokens)
        )
        self._mean_queued = max(self._mean_n, 1.0)
        """predict_system_s's mean length of the requests queued ahead."""
        self._ttft = params.objective == "ttft"
        self._system = params.scope == "system"
        self._queue_weight = math.inf if params.queue_weight is None else params.queue_weight
        self._slo = params.slo_ttft_s is not None or params.slo_tpot_s is not None
        self._eagle_factor = 1.0 - params.eagle_margin
        self._default_n = params.default_output_tokens
        self._scraped_accept = params.scraped_accept_length
        self._prefix_aware = params.prefix_aware
        self._credit_rate = params.prefill_tok_s
        self._prefill_rate: dict[Pool, float | None] = {
            "baseline": self._baseline.prefill_tok_s,
            "eagle": self._eagle.prefill_tok_s,
        }
        self._per_backend: dict[Pool, bool] = {
            p: params.prefix_aware and rate is not None for p, rate in self._prefill_rate.items()
        }
        """Per pool: every backend is predicted (queued prefill differs per backend) and the one a
        request goes to is booked."""
        self._per_b, self._per_e = self._per_backend["baseline"], self._per_backend["eagle"]
        """`_per_backend` of each pool (read by every decision): whether a pool's one backend is
        predicted when it is `usable`, else when it `admits`."""
        self._prefill_ends: dict[str, deque[float]] = {}
        """Per backend: when the prefills this policy sent there and that have not ended yet end
        (its own estimate; one prefill at a time, FIFO, so the times increase)."""
        # hint priors: the profile's measured categories (`specroute bench --prompts`), then the params'
        self._hint_priors = {**(context.profile.mode("eagle").categories or {}), **params.hint_speedup}
        self.calibration: SpeedCalibration | None = None
        if params.calibrate:
            self.calibration = SpeedCalibration(
                params.calibration_buckets,
                window=params.calibration_window,
                prior_weight=params.calibration_prior,
                clip=params.calibration_clip,
                max_hints=params.max_hints,
                hint_idle=params.hint_idle,
                hint_priors=self._hint_priors,
                accept_length=self._profile_accept,
            )
        self.content: ContentAcceptance | None = None
        if params.content_aware:
            self.content = ContentAcceptance(self._hint_priors, self._profile_accept)
        self.reads_features = self.content is not None
        """Content-blind (`content_aware: false`), it never reads `RequestInfo.features`."""
        self.explorer: Explorer | None = None
        if self.content is not None and params.explore_budget > 0.0:
            rng = random.Random(f"{context.seed}/explore")
            self.explorer = Explorer(params.explore, params.explore_budget, params.explore_z, rng)
        self._count_arrivals = self._system and params.count_arrivals
        self._window_size = params.arrival_window
        self._arrivals: deque[tuple[float, bool, int, float]] = deque()
        """(time, to eagle, sequences, sequences x their predicted e2e seconds) of this policy's
        last `arrival_window` decisions."""
        self._arrived_b = self._arrived_e = 0
        """Sequences in `_arrivals` per pool."""
        self._work_b = self._work_e = 0.0
        """Sequence-seconds in `_arrivals` per pool."""
        self._rated = False
        """Whether this decision has the rates below (the window full and spanning time)."""
        self._occ_b = self._occ_e = 0.0
        """Per pool, the mean number of its requests on each of its usable backends (Little's law:
        the sequences/s this policy sends there times their mean predicted e2e)."""
        self._life_b = self._life_e = 0.0
        """Per pool, their mean predicted e2e seconds (0: none sent)."""
        self._reported_caps: dict[str, int] = {}
        """The running-request cap each backend last reported (`BackendLoad.max_running`), for
        `observe` to place an outcome at the batch size its decision assumed."""
        self._content_own: tuple[float, float, float] | None = None
        """(eagle rate multiplier, speed factor, its log-space spread) of the request being decided,
        from its content."""

    def _predict(
        self, pool: Pool, backend: BackendLoad, request: RequestInfo, m: float, now: float
    ) -> Prediction:
        """(TTFT, end-to-end, marginal cost, would queue, time per output token, load) on `backend`
        of a request with `m` decode steps after its first token."""
        occupied = backend.load  # running + queued (scraped when fresh, never below the in-flight count)
        eagle = pool == "eagle"
        model = self._eagle if eagle else self._baseline
        cap = backend.max_running  # the backend's own cap when it reports one, else the profile's
        if cap is None:
            cap = model.max_running_requests
        else:
            self._reported_caps[backend.name] = cap
        own_prefill: float | None = None
        full = cap is not None and occupied >= cap
        batch = occupied + 1 if cap is None or occupied < cap else cap
        cal = self.calibration
        speed = 1.0 if cal is None else cal.speed(pool, batch)
        own = 1.0
        if eagle:
            if self._content_own is not None:
                own = self._content_own[0]
            elif cal is not None:
                hint = request.hint
                if hint is not None or cal.accept_reported:
                    own = math.exp(cal.log_hint(hint))
            elif request.hint is not None:
                own = self._hint_priors.get(request.hint, 1.0)
            accept, profiled = backend.accept_length, self._profile_accept
            if self._scraped_accept and accept is not None and profiled is not None:
                own *= accept / profiled
            drafts = model.speculating  # an adaptive server: acceptance matters where it drafts
            if drafts is not None and not drafts[batch if batch < _TABLE_SIZE else -1]:
                own = 1.0
        prefill_s: float | None = None
        wait = imposed = 0.0
        if self._prefix_aware:
            cached = backend.cached_tokens
            rate = model.prefill_tok_s
            if rate is not None:
                todo = request.prompt_tokens - cached
                prefill_s = own_prefill = (todo if todo > 0 else 0) / rate
                ends = self._prefill_ends.get(backend.name)
                if ends:
                    while ends and ends[0] <= now:
                        ends.popleft()
                    if ends:
                        # The prefill queued ahead is this request's own wait. Its own prefill
                        # delays the requests that will queue behind it: as many, in a steady
                        # state, as it finds ahead (what an arrival sees is what a departure
                        # leaves), each by its prefill time.
                        wait = ends[-1] - now
                        imposed = len(ends) * prefill_s
            elif cached > 0:  # the profile's TTFTs include the prefill: credit what the cache saves
                # never below zero TTFT, before (occupied) or after this request joins
                at = occupied if cap is None or occupied < cap else cap
                prefill_s = -min(cached / self._credit_rate, model.ttft_s(at))
        # SpeedModel.predict_system_s inlined (the hot path: two calls per decision, and the call
        # alone would cost more than the prediction): the same operations in the same order
        # (tests/policies/test_cost_model_inlined.py holds them equal)
        decode_scale = own * speed
        if prefill_s is None:
            prompt, rate = request.prompt_tokens, model.prefill_tok_s
            prefill_s = prompt / rate if prompt > 0 and rate else 0.0
        b = occupied  # (predict_system_s clamps each count at 0: a load is never negative)
        if cap is not None and b >= cap:
            step = model.step_time(cap)
            queue_wait = (b - cap + 1) * self._mean_queued * step / cap
            ttft = (queue_wait + model.ttft_s(cap) + prefill_s) / speed
            e2e = ttft + m * step / decode_scale
            qw = self._queue_weight
            cost = e2e + qw * queue_wait / speed if qw != math.inf else math.inf
        else:
            steps = model.step_table
            if b + 1 < _TABLE_SIZE:
                ttfts = model.ttft_table
                t0, t1, f0, f1 = steps[b], steps[b + 1], ttfts[b], ttfts[b + 1]
            else:
                t0, t1 = model.step_time(b), model.step_time(b + 1)
                f0, f1 = model.ttft_s(b), model.ttft_s(b + 1)
            ttft = (f1 + prefill_s) / speed
            e2e = ttft + m * t1 / decode_scale
            if self._rated:
                # The requests sharing its life, on average: those present (b) leave part way
                # through it and those arriving join part way, each living `life` on average and
                # found at a uniform point of it. Over a life short beside theirs it shares the
                # present batch; over a long one, the pool's mean occupancy (Little's law): the
                # weight of the latter is its share of the life the present no longer fill. With
                # none arriving, the present are taken to live as long as it does. Its first token
                # comes at the start, among those present: only the decode steps move to k.
                if eagle:
                    occ, life = self._occ_e, self._life_e
                else:
                    occ, life = self._occ_b, self._life_b
                x = e2e / life if life > 0.0 else 1.0
                k = b + (0.5 * x if x <= 1.0 else 1.0 - 0.5 / x) * (occ - b)
                if cap is not None and k > cap - 1:
                    k = cap - 1.0
                i = int(k)
                if i + 2 < _TABLE_SIZE:
                    s0, s1, s2 = steps[i], steps[i + 1], steps[i + 2]
                    frac = k - i
                    t0 = s0 + frac * (s1 - s0)
                    t1 = s1 + frac * (s2 - s1)
                else:
                    t0, t1 = float(model.step_time_array(k)), float(model.step_time_array(k + 1))
                after = ttft + m * t1 / decode_scale
                before = (f0 + prefill_s) / speed + m * t0 / decode_scale
                rate_gain = (k + 1.0) * before - k * after
            else:
                after = e2e
                before = (f0 + prefill_s) / speed + m * t0 / decode_scale
                rate_gain = (b + 1) * before - b * e2e
            cost = before * after / rate_gain if rate_gain > 0.0 else math.inf
        tpot = model.step_time(batch) / (own * speed) if self._slo else 0.0
        return ttft + wait, e2e + wait, cost + wait + imposed, full, tpot, occupied, own_prefill

    def _rank(self, p: Prediction) -> float:
        """What `cheapest_backend` minimises within a pool: the quantity pools are compared on."""
        ttft, e2e, cost, queued, _, _, _ = p
        if self._ttft:
            return math.inf if self._system and queued else ttft
        return cost if self._system else e2e

    def _backend(
        self, pool: Pool, members: PoolLoad, request: RequestInfo, m: float, now: float
    ) -> tuple[BackendLoad | None, Prediction] | None:
        """The backend of `pool` this request would go to (None for the routing core's
        least-loaded pick) and its prediction; None when the pool has no healthy backend.
        Prefix-aware, every backend is predicted and the cheapest named: always when the profile
        gives the pool's prefill rate (its queued prefill differs per backend), else when some
        backend holds part of the prompt."""
        backends = members.backends
        if len(backends) == 1:  # the common deployment: nothing to compare
            only = backends[0]
            if self._per_backend[pool]:
                return (only, self._predict(pool, only, request, m, now)) if only.usable else None
            # first_least_loaded of one backend; naming it is what the routing core's pick would do
            if only.admits:
                return only, self._predict(pool, only, request, m, now)
            return None
        if self._prefix_aware and (
            self._prefill_rate[pool] is not None or any(b.cached_tokens for b in backends if b.usable)
        ):
            predictions: dict[str, Prediction] = {}

            def rank(b: BackendLoad) -> float:
                p = predictions[b.name] = self._predict(pool, b, request, m, now)
                return self._rank(p)

            found = cheapest_backend(members, rank)
            return None if found is None else (found[0], predictions[found[0].name])
        least = first_least_loaded(members)
        return None if least is None else (None, self._predict(pool, least, request, m, now))

    def arrivals(self, pool: Pool) -> tuple[float | None, float]:
        """(mean occupancy per backend, mean predicted e2e seconds) of the requests this policy
        sent to `pool` as the last decision measured them; the occupancy None when it measured
        none."""
        if not self._rated:
            return None, 0.0
        if pool == "eagle":
            return self._occ_e, self._life_e
        return self._occ_b, self._life_b

    def reset(self) -> None:
        """A new segment (clock at 0): the prefills booked and the arrivals timed on the old clock
        are gone."""
        self._prefill_ends.clear()
        self._arrivals.clear()
        self._arrived_b = self._arrived_e = 0
        self._work_b = self._work_e = 0.0
        self._rated = False

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        n = request.max_tokens or self._default_n
        # predict_system_s's decode steps after the first token, `(max(n, 1) - 1)`, as a float:
        # the same products (an int operand is converted exactly so), on the float-only fast path
        m = float(n - 1 if n > 1 else 0)
        content = self.content
        own = self._content_own = (
            None if content is None or request.features is None else content.factor(request, self.calibration)
        )
        bs, es = view.baseline.backends, view.eagle.backends
        if self._count_arrivals:
            # Each pool's mean occupancy per usable backend (its requests are shared among them)
            # over the window, which spans `span` seconds to now, and their mean predicted e2e.
            # Inline (not a method): the window moves with every decision, so this runs on each.
            window = self._arrivals
            span = now - window[0][0] if len(window) >= self._window_size else 0.0
            self._rated = rated = span > 0.0
            if rated:
                work_b, work_e = self._work_b, self._work_e
                ab, ae = self._arrived_b, self._arrived_e
                if len(bs) < 2:
                    self._occ_b = work_b / span  # (span * 1: the same float)
                else:
                    self._occ_b = work_b / (span * max(sum(1 for b in bs if b.usable), 1))
                if len(es) < 2:
                    self._occ_e = work_e / span
                else:
                    self._occ_e = work_e / (span * max(sum(1 for b in es if b.usable), 1))
                self._life_b = work_b / ab if ab > 0 else 0.0
                self._life_e = work_e / ae if ae > 0 else 0.0
        # One backend per pool, the common deployment: `_backend`'s answer without the call
        # (it is one per pool per decision), the same test of the backend
        if len(bs) == 1 and (bs[0].usable if self._per_b else bs[0].admits):
            on_b: tuple[BackendLoad | None, Prediction] | None = (
                bs[0],
                self._predict("baseline", bs[0], request, m, now),
            )
        else:
            on_b = self._backend("baseline", view.baseline, request, m, now)
        if len(es) == 1 and (es[0].usable if self._per_e else es[0].admits):
            on_e: tuple[BackendLoad | None, Prediction] | None = (
                es[0],
                self._predict("eagle", es[0], request, m, now),
            )
        else:
            on_e = self._backend("eagle", view.eagle, request, m, now)
        if on_b is None or on_e is None:  # the routing core's fallback (rule 4)
            pool, reason = fallback({"baseline": on_b, "eagle": on_e})
            on = on_b if pool == "baseline" else on_e
            assert on is not None
            ttfts: dict[Pool, float] = {pool: on[1][0]}
            e2es: dict[Pool, float] = {pool: on[1][1]}
            accept_factor = None
        else:
            tb, eb, _, _, pb, _, _ = on_b[1]
            te, ee, _, _, pe, _, _ = on_e[1]
            pool, reason, xe, xb = self._verdict(on_e[1], on_b[1])
            if self._slo:
                p = self.params
                meets_b = (p.slo_ttft_s is None or tb <= p.slo_ttft_s) and (
                    p.slo_tpot_s is None or pb <= p.slo_tpot_s
                )
                meets_e = (p.slo_ttft_s is None or te <= p.slo_ttft_s) and (
                    p.slo_tpot_s is None or pe <= p.slo_tpot_s
                )
                if meets_b != meets_e:  # one pool is predicted to meet every SLO, the other to miss one
                    met: Pool = "baseline" if meets_b else "eagle"
                    if met != pool:
                        pool, reason = met, "slo_eagle" if met == "eagle" else "slo_baseline"
            explorer = self.explorer
            if explorer is not None and own is not None:  # a request without content has nothing to explore
                if pool == "baseline" and reason != "slo_baseline":
                    regret = xe - xb if xe > xb else 0.0
                    shift = explorer.draw(own[2]) if explorer.affords(regret) else 0.0
                    if shift > 0.0 and self._tried(shift, own, view, request, m, now, on_b[1]):
                        pool, reason = "eagle", "explore"
                        explorer.spend(regret)
                explorer.accrue(eb if pool == "baseline" else ee)
            on = on_b if pool == "baseline" else on_e
            ttfts = {"baseline": tb, "eagle": te}
            e2es = {"baseline": eb, "eagle": ee}
            accept_factor = None if own is None else own[1]
        # The decision (the backend named with its load when there is one), booked in the arrival
        # window and, prefix-aware at a profiled rate, its prefill on that backend
        if self._count_arrivals:
            sequences = request.sequences
            work = sequences * e2es[pool]
            window = self._arrivals
            eagle = pool == "eagle"
            window.append((now, eagle, sequences, work))
            if eagle:
                self._arrived_e += sequences
                self._work_e += work
            else:
                self._arrived_b += sequences
                self._work_b += work
            if len(window) > self._window_size:  # the oldest leaves
                _, eagle, sequences, work = window.popleft()
                if eagle:
                    self._arrived_e -= sequences
                    self._work_e -= work
                else:
                    self._arrived_b -= sequences
                    self._work_b -= work
        b = on[0]
        if b is None:
            return Decision(pool, "", reason, ttfts, e2es, 0, self.name, accept_factor)
        prediction = on[1]
        prefill_s = prediction[6]
        if prefill_s is not None:  # `_per_backend[pool]`: book its prefill
            ends = self._prefill_ends.get(b.name)
            if ends is None:
                ends = self._prefill_ends[b.name] = deque()
            # (`_predict` has dropped the prefills ended by `now`)
            ends.append(ends[-1] + prefill_s if ends else now + prefill_s)
        return Decision(pool, b.name, reason, ttfts, e2es, prediction[5], self.name, accept_factor)

    def _verdict(self, e: Prediction, b: Prediction) -> tuple[Pool, str, float, float]:
        """(pool, reason, eagle's compared quantity, baseline's) for predictions `e` and `b`.

        The smaller quantity wins, EAGLE only by `eagle_margin` (reason `eagle_margin` when it
        is smaller by less). System scope compares marginal costs (e2e) or, for TTFT, avoids a
        queue while the other pool has a free slot; request scope the request's own time. Where
        both marginal costs are infinite (neither pool gains from one more request), the
        request's own time decides. The reason is `faster_<pool>` when the chosen pool's own
        predicted time (e2e, or TTFT) is no larger than the other's, else `cheaper_<pool>`
        (system scope's marginal cost decided)."""
        te, ee, ce, qe = e[0], e[1], e[2], e[3]
        tb, eb, cb, qb = b[0], b[1], b[2], b[3]
        xe, xb = mine, other = (te, tb) if self._ttft else (ee, eb)
        if self._system:
            if self._ttft:
                if qe != qb:
                    xe, xb = (math.inf, 0.0) if qe else (0.0, math.inf)
            elif ce != cb:
                xe, xb = ce, cb
        if xe < xb * self._eagle_factor:
            return "eagle", "faster_eagle" if mine <= other else "cheaper_eagle", xe, xb
        if xe < xb:
            return "baseline", "eagle_margin", xe, xb
        return "baseline", "faster_baseline" if other <= mine else "cheaper_baseline", xe, xb

    def _tried(
        self,
        shift: float,
        own: tuple[float, float, float],
        view: LoadView,
        request: RequestInfo,
        m: float,
        now: float,
        b: Prediction,
    ) -> bool:
        """Whether EAGLE wins at the request's factor taken `shift` (log) faster than predicted."""
        k = math.exp(shift)
        self._content_own = (own[0] * k, own[1] * k, own[2])
        try:
            tried = self._backend("eagle", view.eagle, request, m, now)
        finally:
            self._content_own = own
        if tried is None:
            return False
        return self._verdict(tried[1], b)[0] == "eagle"

    def observe(self, outcome: Outcome) -> None:
        cal = self.calibration
        if cal is None or not teaches(outcome):
            return  # only requests this policy routed to where they ran teach it
        decision = outcome.decision
        rate = outcome.decode_tok_s
        pool = decision.pool
        model = self._baseline if pool == "baseline" else self._eagle
        batch = decision.backend_load + outcome.request.sequences  # this request ran in the batch too
        cap = self._reported_caps.get(decision.backend) if self._reported_caps else None
        if cap is None:
            cap = model.max_running_requests
        if cap is not None and batch > cap:
            batch = cap
        if rate is None:
            ratio = None
        else:  # step_time inlined
            ratio = rate * (model.step_table[batch] if 0 <= batch < _TABLE_SIZE else model.step_time(batch))
        if pool == "eagle" and self.content is not None and outcome.request.features is not None:
            # (a reported accept length teaches the content model even without a rate)
            ratio = self.content.observe(outcome, cal, batch, ratio)
        if ratio is not None:
            cal.observe(pool, batch, outcome.request.hint, ratio, outcome.accept_length)

    def state(self) -> dict[str, Any]:
        """What it learned (`policies.learned`): the calibration, the content model and the
        exploration's counters, each None when the parameters turn it off. Booked prefills and
        timed arrivals are tied to the clock: not kept."""
        return {
            "version": STATE_VERSION,
            "calibration": None if self.calibration is None else self.calibration.state(),
            "content": None if self.content is None else self.content.model.state(),
            "explore": None if self.explorer is None else self.explorer.state(),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        s = check_version(state, "cost_model", STATE_VERSION)
        parts: dict[str, Learner | None] = {
            "calibration": self.calibration,
            "content": None if self.content is None else self.content.model,
            "explore": self.explorer,
        }
        for key, part in parts.items():
            if (field(s, key, "cost_model") is None) != (part is None):
                raise StateError(
                    f"cost_model: {key} was {'off' if part else 'on'} when saved (other parameters)"
                )
        loaded: list[tuple[Learner, dict[str, Any]]] = []
        try:
            for key, part in parts.items():
                if part is not None:
                    before = part.state()
                    part.load_state(s[key])
                    loaded.append((part, before))
        except ValueError:  # one part refused: the others go back to what they were
            for part, before in loaded:
                part.load_state(before)
            raise


STATE_VERSION = 2
"""The layout of `CostModelPolicy.state()` (1: without the exploration's counters)."""


SPEC = PolicySpec(
    name="cost_model",
    params=CostModelParams,
    factory=CostModelPolicy,
    help="Predict each pool's cost from the speed profile and its current load (system scope: the "
    "request's own time plus the slowdown it imposes; a queued request produces nothing); pick the "
    "cheaper. Calibrates the profile from outcomes.",
    needs_profile=True,
)
