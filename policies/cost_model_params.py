"""`cost_model`'s parameters (`policies.cost_model` re-exports them).

A module of their own so that the policy's decision code compiles with mypyc
(`simulator.native`): a pydantic model cannot be compiled.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, field_validator

from policies.calibration import check_bounds
from policies.explore import ExploreMode

Objective = Literal["e2e", "ttft"]
Scope = Literal["system", "request"]
DEFAULT_BUCKETS = [1, 2, 4, 8, 16, 32, 48, 64, 128, 256]
DEFAULT_PREFILL_TOK_S = 10_000.0
"""Prefill rate assumed for a profile that gives none: the order of magnitude of one GPU node
prefilling a mid-size model (SGLang serves tens of thousands of prompt tokens per second on an
8-GPU node for 8B-70B models); it only prices the tokens a cache saves."""


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
    prefix_aware: bool = Field(
        default=True,
        description="Count only the prefill of the prompt tokens a backend does not hold in its prefix "
        "cache, and pick the cheapest backend within a pool when some backend holds part of the prompt; "
        "false: cache-blind (least-loaded backend, cached tokens ignored).",
    )
    prefill_tok_s: float = Field(
        default=DEFAULT_PREFILL_TOK_S,
        gt=0,
        description="Prefill rate (prompt tokens/s) that prices cached tokens when the profile gives no "
        "prefill_tok_s (the profile's own rate wins).",
    )
    content_aware: bool = Field(
        default=True,
        description="Predict each request's eagle speed factor from its content features (text grams, "
        "sampling parameters, hint), learned online from outcomes (policies/acceptance.py); false: one "
        "eagle rate per hint (content-blind).",
    )
    explore: ExploreMode = Field(
        default="optimistic",
        description="Content-aware: how a request predicted cheaper on the plain pool is tried on EAGLE "
        "to learn its kind's speed there (policies/explore.py): optimistic (its speed factor taken "
        "explore_z standard deviations above the prediction) or thompson (a sample of it).",
    )
    explore_budget: float = Field(
        default=0.01,
        ge=0.0,
        le=0.5,
        description="Content-aware: predicted regret exploration may spend, as a share of the predicted "
        "end-to-end time of the requests routed (0: never explore).",
    )
    explore_z: float = Field(
        default=1.0, gt=0.0, description="explore=optimistic: standard deviations above the mean tried."
    )
    count_arrivals: bool = Field(
        default=True,
        description="System scope: a request's marginal cost counts the requests expected to share its "
        "backend during its life -- those present leave part way through it, those arriving (at the rate "
        "and with the mean predicted e2e of what this policy sent to the pool in its last arrival_window "
        "decisions) join part way -- instead of those present, for its whole life.",
    )
    arrival_window: int = Field(
        default=64,
        ge=2,
        description="count_arrivals: decisions over which each pool's arrival rate and the mean "
        "predicted e2e of its requests are measured.",
    )
    hint_idle: int = Field(
        default=1000,
        ge=1,
        description="A new hint may take the slot of a hint not seen in this many hinted outcomes.",
    )

    _buckets = field_validator("calibration_buckets")(check_bounds)
