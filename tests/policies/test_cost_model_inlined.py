"""`cost_model` computes its predictions with `SpeedModel.predict_system_s` inlined (the hot path
of every decision): the inlined copy must give the very same floats, to the bit, as the method
does for the same inputs -- below the cap, at it and beyond it, with prefill priced by the profile
or credited for cached tokens, with calibrated speeds and hint factors, for both scopes and for a
finite queue weight -- and choose the pool the method's costs say."""

from __future__ import annotations

import math
import random

import pytest
from helpers import KIMI

from policies.base import BackendLoad, Decision, LoadView, Outcome, Pool, PoolLoad, RequestInfo
from policies.cost_model import CostModelParams, CostModelPolicy
from policies.profile import Profile, parse_profile
from policies.spec import PolicyContext


def _without_prefill_rate(profile: Profile) -> Profile:
    data = profile.model_dump(mode="json", exclude_none=True)
    for mode in data["modes"].values():
        mode.pop("prefill_tok_s", None)
    return parse_profile(data)


NO_RATE = _without_prefill_rate(KIMI)


def _trained(profile: Profile, params: CostModelParams, rng: random.Random) -> CostModelPolicy:
    """A policy whose calibration has moved off the profile (speeds and a hint's term != 1)."""
    policy = CostModelPolicy(params, PolicyContext(profile, 0))
    for i in range(300):
        pool: Pool = "eagle" if i % 2 else "baseline"
        hint = "code" if i % 3 == 0 else None
        load = rng.randrange(0, 300)
        d = Decision(pool, f"{pool[0]}0", "x", {}, {}, load, "cost_model")
        tokens = rng.randrange(2, 500)
        policy.observe(
            Outcome(RequestInfo(max_tokens=tokens, hint=hint), d, 0.0, 0.3, tokens, 0.3 + tokens / 70.0, "ok")
        )
    return policy


def _expected(
    policy: CostModelPolicy, pool: Pool, b: BackendLoad, request: RequestInfo, n: int
) -> tuple[float, float, float]:
    """What `predict_system_s` says for this backend, with the inputs `cost_model` gives it."""
    profile_mode = policy._eagle if pool == "eagle" else policy._baseline
    running, queued = (b.in_flight, 0) if b.running is None else (b.running, b.queued or 0)
    cap = profile_mode.max_running_requests
    occupied = running + queued
    batch = occupied + 1 if cap is None or occupied < cap else cap
    cal = policy.calibration
    assert cal is not None
    speed = cal.speed(pool, batch)
    own = math.exp(cal.log_hint(request.hint)) if pool == "eagle" and request.hint is not None else 1.0
    rate = profile_mode.prefill_tok_s
    prefill_s: float | None = None
    if rate is not None:
        prefill_s = max(request.prompt_tokens - b.cached_tokens, 0) / rate
    elif b.cached_tokens > 0:
        at = occupied if cap is None or occupied < cap else cap
        prefill_s = -min(b.cached_tokens / policy.params.prefill_tok_s, profile_mode.ttft_s(at))
    return profile_mode.predict_system_s(
        n,
        running,
        queued,
        policy._mean_n,
        request.prompt_tokens,
        own,
        speed,
        policy._queue_weight,
        prefill_s,
        *policy.arrivals(pool),
    )


@pytest.mark.parametrize("profile", [KIMI, NO_RATE], ids=["prefill_rate", "ttft_includes_prefill"])
@pytest.mark.parametrize(
    "params",
    [
        CostModelParams(),
        CostModelParams(scope="request"),
        CostModelParams(queue_weight=3.0, mean_output_tokens=120.0),
        CostModelParams(queue_weight=None),
        CostModelParams(count_arrivals=False),
    ],
    ids=["default", "request_scope", "queue_weight_3", "never_queue", "present_only"],
)
def test_inlined_predictions_equal_predict_system_s_to_the_bit(
    profile: Profile, params: CostModelParams
) -> None:
    rng = random.Random(7)
    policy = _trained(profile, params, rng)
    now = 0.0
    measured = 0
    for _ in range(400):
        # every booked prefill (at most 3000 tokens) has drained: no queued-prefill wait; the
        # arrival rates the decisions measure vary
        now += rng.choice([0.5, 2.0, 30.0])
        loads = [rng.choice([0, 1, 5, 47, 48, 49, 100, 255, 256, 300, 5000]) for _ in range(4)]
        b = BackendLoad("b0", "baseline", True, loads[0] + loads[1], 0, loads[0], loads[1],
                        cached_tokens=rng.choice([0, 0, 64, 4096]))  # fmt: skip
        e = BackendLoad("e0", "eagle", True, loads[2] + loads[3], 0, loads[2], loads[3], 2.4,
                        cached_tokens=rng.choice([0, 0, 64, 4096]))  # fmt: skip
        request = RequestInfo(
            prompt_tokens=rng.choice([0, 1, 256, 3000]),
            max_tokens=rng.choice([None, 1, 2, 50, 700]),
            hint=rng.choice([None, "code"]),
        )
        n = request.max_tokens or policy.params.default_output_tokens
        d = policy.choose(request, LoadView(PoolLoad("baseline", (b,)), PoolLoad("eagle", (e,))), now)
        measured += policy.arrivals("eagle")[0] is not None
        tb, eb, cb = _expected(policy, "baseline", b, request, n)
        te, ee, ce = _expected(policy, "eagle", e, request, n)
        assert d.predicted_ttft_s == {"baseline": tb, "eagle": te}
        assert d.predicted_e2e_s == {"baseline": eb, "eagle": ee}
        if params.scope == "system" and ce != cb:
            xe, xb = ce, cb
        else:
            xe, xb = ee, eb
        assert d.pool == ("eagle" if xe < xb else "baseline")
        assert d.backend == ("e0" if d.pool == "eagle" else "b0")
        assert d.backend_load == (e if d.pool == "eagle" else b).load
    # system scope counting arrivals measures the rates once the window is full
    assert measured == (400 - params.arrival_window if policy._count_arrivals else 0)
