"""`cost_model`: send each request to the pool predicted to finish it sooner.

How it works: for each pool take its least-loaded healthy backend (backend-reported running
and queued requests when a fresh sample exists, else this proxy's in-flight count as running)
and ask the speed profile for the request's (TTFT, end-to-end) time if it joined that backend
now (`SpeedModel.predict_e2e_s`: batch slowdown, plus the queue wait past
`max_running_requests`). The pool with the smaller prediction (end-to-end by default, or
TTFT) wins. Both pools are capacity: under heavy load work still goes to eagle while eagle
is faster than queueing on baseline. The predictions for both pools go into the `Decision`
so predicted-vs-actual can be measured.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat

from policies.base import BackendLoad, Decision, LoadView, NoHealthyBackend, Outcome, Pool, RequestInfo
from policies.profile import SpeedModel
from policies.routing import backend_counts, first_least_loaded, route
from policies.spec import PolicyContext, PolicyError, PolicySpec

Objective = Literal["e2e", "ttft"]


class CostModelParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    objective: Objective = Field(
        default="e2e", description="What to minimise: end-to-end time (e2e) or time to first token (ttft)."
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
        description="Eagle is chosen only when predicted at least this fraction faster than baseline.",
    )
    hint_speedup: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Factor on the eagle decode rate per x-specroute-hint, e.g. "
        '{"code": 1.2, "prose": 0.8} (the drafter\'s acceptance depends on the domain).',
    )
    scraped_accept_length: bool = Field(
        default=False,
        description="Scale the eagle decode rate by the backend-reported accept length over the profile's "
        "accept_length.",
    )


class CostModelPolicy:
    name = "cost_model"

    def __init__(self, params: CostModelParams, context: PolicyContext) -> None:
        if context.profile is None:
            raise PolicyError("policy 'cost_model' needs a speed profile (--profile FILE)")
        missing = [m for m in ("baseline", "eagle") if m not in context.profile.modes]
        if missing:
            raise PolicyError(f"policy 'cost_model': the profile has no {' or '.join(missing)} mode")
        self.params = params
        self._rng = random.Random(context.seed)
        self._baseline: SpeedModel = context.profile.speed("baseline")
        self._eagle: SpeedModel = context.profile.speed("eagle")
        self._profile_accept = self._eagle.accept_length
        self._mean_n = (
            params.mean_output_tokens
            if params.mean_output_tokens is not None
            else float(params.default_output_tokens)
        )
        self._ttft = params.objective == "ttft"
        self._eagle_factor = 1.0 - params.eagle_margin
        self._default_n = params.default_output_tokens
        self._scraped_accept = params.scraped_accept_length

    def _eagle_scale(self, request: RequestInfo, backend: BackendLoad) -> float:
        scale = 1.0
        if request.hint is not None:
            scale = self.params.hint_speedup.get(request.hint, 1.0)
        if (
            self.params.scraped_accept_length
            and backend.accept_length is not None
            and self._profile_accept is not None
        ):
            scale *= backend.accept_length / self._profile_accept
        return scale

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        n = request.max_tokens or self._default_n
        ttft: dict[Pool, float] = {}
        e2e: dict[Pool, float] = {}
        b = first_least_loaded(view.baseline)
        if b is not None:
            running, queued = backend_counts(b)
            ttft["baseline"], e2e["baseline"] = self._baseline.predict_e2e_s(
                n, running, queued, mean_output_tokens=self._mean_n, prompt_tokens=request.prompt_tokens
            )
        e = first_least_loaded(view.eagle)
        if e is not None:
            running, queued = backend_counts(e)
            scale = 1.0
            if request.hint is not None or self._scraped_accept:
                scale = self._eagle_scale(request, e)
            ttft["eagle"], e2e["eagle"] = self._eagle.predict_e2e_s(
                n,
                running,
                queued,
                mean_output_tokens=self._mean_n,
                prompt_tokens=request.prompt_tokens,
                rate_scale=scale,
            )
        if request.forced_pool is not None:
            pool, reason = request.forced_pool, "client_override"
        elif e is None:
            if b is None:
                raise NoHealthyBackend("no healthy backend in either pool")
            pool, reason = "baseline", "eagle_unavailable"
        elif b is None:
            pool, reason = "eagle", "baseline_unavailable"
        else:
            cost = ttft if self._ttft else e2e
            if cost["eagle"] < cost["baseline"] * self._eagle_factor:
                pool, reason = "eagle", "faster_eagle"
            else:
                pool, reason = "baseline", "faster_baseline"
        return route(
            view, pool, reason, self._rng, policy=self.name, predicted_ttft_s=ttft, predicted_e2e_s=e2e
        )

    def observe(self, outcome: Outcome) -> None:
        pass


SPEC = PolicySpec(
    name="cost_model",
    params=CostModelParams,
    factory=CostModelPolicy,
    help="Predict each pool's end-to-end time (or TTFT) from the speed profile and its current load; "
    "pick the faster.",
    needs_profile=True,
)
