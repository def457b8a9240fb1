"""`cost_model`: send each request where it costs the whole system least, by the speed profile.

How it works: for each pool take its least-loaded healthy backend (backend-reported running
and queued requests when a fresh sample exists, else this proxy's in-flight count as running)
and ask the speed profile what the request would cost there (`SpeedModel.predict_system_s`):

- `scope=system` (the default) compares marginal costs: the request's own end-to-end time
  plus the time it adds to the requests it slows down -- exactly, the seconds per request at
  the margin of the pool's completion rate, so the pool chosen is the one whose total rate
  grows most. A request that would wait in a full pool's queue adds nothing there (a queued
  request produces nothing): its cost is infinite while the other pool still gains from one
  more request. When neither gains, the request goes where it finishes sooner.
- `scope=request` is the selfish rule: the pool that finishes this request sooner.

`objective=ttft` compares times to first token instead (system scope: never a queue while the
other pool has a free slot). With `slo_ttft_s` / `slo_tpot_s`, a pool predicted to miss an SLO
is not chosen while the other is predicted to meet it.

Calibration (`calibrate`, on by default): the profile is a prior. Every outcome of a request
this policy routed teaches `policies.calibration.SpeedCalibration` how far the pool's real
decode rate is from the profile's at that load, and (eagle) how a hint's acceptance differs;
predictions use the corrected speeds. `hint_speedup` factors are priors for the hints named.
The predictions for both pools go into the `Decision`, so predicted-vs-actual can be measured.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, field_validator

from policies.base import POOLS, BackendLoad, Decision, LoadView, NoHealthyBackend, Outcome, Pool, RequestInfo
from policies.calibration import SpeedCalibration, check_bounds
from policies.profile import SpeedModel
from policies.routing import backend_counts, first_least_loaded, pool_decision
from policies.spec import PolicyContext, PolicyError, PolicySpec

Objective = Literal["e2e", "ttft"]
Scope = Literal["system", "request"]
DEFAULT_BUCKETS = [1, 2, 4, 8, 16, 32, 48, 64, 128, 256]


class CostModelParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    scope: Scope = Field(
        default="system",
        description="system: least total cost to every request (own time plus the slowdown imposed on "
        "the others; a queued request produces nothing); request: finish this request soonest (selfish).",
    )
    queue_weight: float | None = Field(
        default=100.0,
        ge=0.0,
        description="System scope: a request joining a full pool's queue costs its own time plus this many "
        "times its wait (the wait it passes on to those queueing behind it); null: never queue while the "
        "other pool has room.",
    )
    objective: Objective = Field(
        default="e2e", description="What to minimise: end-to-end time (e2e) or time to first token (ttft)."
    )
    slo_ttft_s: float | None = Field(
        default=None,
        gt=0,
        description="TTFT SLO: a pool predicted to miss it is not chosen while the other meets it.",
    )
    slo_tpot_s: float | None = Field(
        default=None,
        gt=0,
        description="Time-per-output-token SLO: a pool predicted to miss it is not chosen while the other "
        "meets it.",
    )
    default_output_tokens: int = Field(
        default=256, ge=1, description="Output tokens assumed for a request that sets no max_tokens."
    )
    mean_output_tokens: float | None = Field(
        default=None,
        gt=0,
        description="Mean output tokens of the requests queued ahead (queue-wait estimate); "
        "default: default_output_tokens.",
    )
    eagle_margin: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="Eagle is chosen only when its cost is at least this fraction below baseline's.",
    )
    hint_speedup: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Factor on the eagle decode rate per x-specroute-hint, e.g. "
        '{"code": 1.2, "prose": 0.8} (the drafter\'s acceptance depends on the domain); with '
        "calibrate, the starting point for those hints.",
    )
    scraped_accept_length: bool = Field(
        default=False,
        description="Scale the eagle decode rate by the backend-reported accept length over the profile's "
        "accept_length.",
    )
    calibrate: bool = Field(
        default=True,
        description="Correct the profile from outcomes: speed per (pool, load bucket), eagle acceptance per "
        "hint.",
    )
    calibration_window: int = Field(
        default=200, ge=1, description="Samples a calibration estimate remembers (it follows drift)."
    )
    calibration_prior: float = Field(
        default=10.0,
        ge=0.0,
        description="Weight of the profile (in samples) against the first observations; load buckets "
        "use 4x this.",
    )
    calibration_clip: float = Field(
        default=1.5,
        gt=1.0,
        description="One observation is clipped to within this factor of the current estimate (bounds what "
        "an outlier can do; a larger drift is still followed, over several observations).",
    )
    calibration_buckets: list[int] = Field(
        default=DEFAULT_BUCKETS,
        min_length=1,
        description="Upper bounds of the load buckets (requests on the backend including this one); one "
        "more bucket holds everything above the last bound.",
    )
    max_hints: int = Field(default=32, ge=0, description="Distinct hints calibrated (0: none).")
    hint_idle: int = Field(
        default=1000,
        ge=1,
        description="A new hint may take the slot of a hint not seen in this many hinted outcomes.",
    )

    _buckets = field_validator("calibration_buckets")(check_bounds)


class CostModelPolicy:
    name = "cost_model"

    def __init__(self, params: CostModelParams, context: PolicyContext) -> None:
        if context.profile is None:
            raise PolicyError("policy 'cost_model' needs a speed profile (--profile FILE)")
        missing = [m for m in ("baseline", "eagle") if m not in context.profile.modes]
        if missing:
            raise PolicyError(f"policy 'cost_model': the profile has no {' or '.join(missing)} mode")
        self.params = params
        self._speed: dict[Pool, SpeedModel] = {
            "baseline": context.profile.speed("baseline"),
            "eagle": context.profile.speed("eagle"),
        }
        self._profile_accept = self._speed["eagle"].accept_length
        self._mean_n = (
            params.mean_output_tokens
            if params.mean_output_tokens is not None
            else float(params.default_output_tokens)
        )
        self._ttft = params.objective == "ttft"
        self._system = params.scope == "system"
        self._queue_weight = math.inf if params.queue_weight is None else params.queue_weight
        self._slo = params.slo_ttft_s is not None or params.slo_tpot_s is not None
        self._eagle_factor = 1.0 - params.eagle_margin
        self._default_n = params.default_output_tokens
        self._scraped_accept = params.scraped_accept_length
        self.calibration: SpeedCalibration | None = None
        if params.calibrate:
            self.calibration = SpeedCalibration(
                params.calibration_buckets,
                window=params.calibration_window,
                prior_weight=params.calibration_prior,
                clip=params.calibration_clip,
                max_hints=params.max_hints,
                hint_idle=params.hint_idle,
                hint_priors=params.hint_speedup,
                accept_length=self._profile_accept,
            )

    def _cap(self, pool: Pool, batch: int) -> int:
        cap = self._speed[pool].max_running_requests
        return batch if cap is None or batch <= cap else cap

    def _scales(
        self, pool: Pool, request: RequestInfo, backend: BackendLoad, batch: int
    ) -> tuple[float, float]:
        """(this request's own decode-rate factor, the server's speed scale) at `batch`."""
        cal = self.calibration
        speed = 1.0 if cal is None else math.exp(cal.log_speed(pool, self._cap(pool, batch)))
        if pool == "baseline":
            return 1.0, speed
        own = 1.0
        if cal is not None:
            if request.hint is not None or cal.accept_reported:
                own = math.exp(cal.log_hint(request.hint))
        elif request.hint is not None:
            own = self.params.hint_speedup.get(request.hint, 1.0)
        if self._scraped_accept and backend.accept_length is not None and self._profile_accept is not None:
            own *= backend.accept_length / self._profile_accept
        return own, speed

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        n = request.max_tokens or self._default_n
        ttft: dict[Pool, float] = {}
        e2e: dict[Pool, float] = {}
        cost: dict[Pool, float] = {}
        tpot: dict[Pool, float] = {}
        for pool in POOLS:
            backend = first_least_loaded(view.baseline if pool == "baseline" else view.eagle)
            if backend is None:
                continue
            running, queued = backend_counts(backend)
            own, speed = 1.0, 1.0
            if self.calibration is not None or (pool == "eagle" and (request.hint or self._scraped_accept)):
                own, speed = self._scales(pool, request, backend, running + queued + 1)
            model = self._speed[pool]
            ttft[pool], e2e[pool], cost[pool] = model.predict_system_s(
                n,
                running,
                queued,
                mean_output_tokens=self._mean_n,
                prompt_tokens=request.prompt_tokens,
                rate_scale=own,
                speed_scale=speed,
                queue_weight=self._queue_weight,
            )
            if self._slo:
                tpot[pool] = model.step_time(self._cap(pool, running + queued + 1)) / (own * speed)
        if len(e2e) < 2:
            if not e2e:
                raise NoHealthyBackend("no healthy backend in either pool")
            pool = "baseline" if "baseline" in e2e else "eagle"
            reason = f"{'eagle' if pool == 'baseline' else 'baseline'}_unavailable"
        else:
            pool = self._pick(ttft, e2e, cost)
            reason = "faster_eagle" if pool == "eagle" else "faster_baseline"
            if self._slo:
                met = self._meets_slo(ttft, tpot)
                if met is not None and met != pool:
                    pool, reason = met, "slo_eagle" if met == "eagle" else "slo_baseline"
        return pool_decision(pool, reason, policy=self.name, predicted_ttft_s=ttft, predicted_e2e_s=e2e)

    def _pick(self, ttft: dict[Pool, float], e2e: dict[Pool, float], cost: dict[Pool, float]) -> Pool:
        own = ttft if self._ttft else e2e
        if self._system:
            ce, cb = cost["eagle"], cost["baseline"]
            if ce != cb:  # at most one of them is infinite: the one where it would queue
                if self._ttft and math.isfinite(ce) and math.isfinite(cb):
                    ce, cb = own["eagle"], own["baseline"]
                return "eagle" if ce < cb * self._eagle_factor else "baseline"
        return "eagle" if own["eagle"] < own["baseline"] * self._eagle_factor else "baseline"

    def _meets_slo(self, ttft: dict[Pool, float], tpot: dict[Pool, float]) -> Pool | None:
        """The one pool predicted to meet every SLO while the other misses one; else None."""
        p = self.params
        meets: list[Pool] = [
            pool
            for pool in POOLS
            if (p.slo_ttft_s is None or ttft[pool] <= p.slo_ttft_s)
            and (p.slo_tpot_s is None or tpot[pool] <= p.slo_tpot_s)
        ]
        return meets[0] if len(meets) == 1 else None

    def observe(self, outcome: Outcome) -> None:
        cal = self.calibration
        if cal is None or outcome.status != "ok" or outcome.request.forced_pool is not None:
            return  # only requests this policy routed teach it (a client cannot steer it)
        decision = outcome.decision
        if decision.reason == "failover":
            return  # its load at decision time was another backend's
        rate = outcome.decode_tok_s
        if rate is None:
            return
        pool = decision.pool
        batch = self._cap(pool, decision.backend_load + 1)
        cal.observe(
            pool,
            batch,
            outcome.request.hint,
            rate / self._speed[pool].decode_tok_s(batch),
            outcome.accept_length,
        )


SPEC = PolicySpec(
    name="cost_model",
    params=CostModelParams,
    factory=CostModelPolicy,
    help="Predict each pool's cost from the speed profile and its current load (system scope: the "
    "request's own time plus the slowdown it imposes; a queued request produces nothing); pick the "
    "cheaper. Calibrates the profile from outcomes.",
    needs_profile=True,
)
