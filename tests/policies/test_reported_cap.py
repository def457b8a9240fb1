"""A backend's reported running-request cap (`BackendLoad.max_running`: SGLang's `/server_info`,
`/v1/loads`, vLLM's learned full batch) is the cap `cost_model` predicts its queue from; the
profile's `max_running_requests` only when the backend reports none (always in the simulator,
whose servers run the profile)."""

from __future__ import annotations

from dataclasses import replace

from helpers import KIMI

from policies.base import BackendLoad, Decision, LoadView, Outcome, PoolLoad, RequestInfo
from policies.registry import default_registry
from policies.spec import PolicyContext

REQUEST = RequestInfo(endpoint="chat", stream=True, prompt_tokens=100, max_tokens=200)
PROFILE_CAP = KIMI.mode("eagle").max_running_requests or 0  # 48


def policy(**params: object) -> object:
    return default_registry(entry_points=False).create("cost_model", params, PolicyContext(KIMI, 0))


def view(eagle_running: int, eagle_cap: int | None) -> LoadView:
    base = BackendLoad("b", "baseline", running=0, queued=0, sample_age_s=0.0)
    eagle = BackendLoad(
        "e", "eagle", in_flight=eagle_running, running=eagle_running, queued=0, sample_age_s=0.0,
        max_running=eagle_cap,
    )  # fmt: skip
    return LoadView(PoolLoad("baseline", (base,)), PoolLoad("eagle", (eagle,)))


def test_a_reported_cap_below_the_profiles_makes_the_policy_predict_the_queue() -> None:
    assert PROFILE_CAP == 48
    unreported = policy().choose(REQUEST, view(4, None), 0.0)  # type: ignore[attr-defined]
    at_cap = policy().choose(REQUEST, view(4, 4), 0.0)  # type: ignore[attr-defined]
    # 4 running of the profile's 48: joins the batch; of the reported 4: waits for a completion
    assert at_cap.predicted_e2e_s["eagle"] > unreported.predicted_e2e_s["eagle"]
    assert at_cap.predicted_ttft_s["eagle"] > unreported.predicted_ttft_s["eagle"]
    assert (
        at_cap.predicted_ttft_s["baseline"] == unreported.predicted_ttft_s["baseline"]
    )  # the other pool's as it was
    # system scope: a queued request produces nothing while baseline has room
    assert (at_cap.pool, at_cap.reason) == ("baseline", "faster_baseline")
    below_cap = policy().choose(REQUEST, view(3, 4), 0.0)  # type: ignore[attr-defined]
    assert below_cap.predicted_e2e_s["eagle"] < at_cap.predicted_e2e_s["eagle"]


def test_a_reported_cap_above_the_profiles_lifts_the_predicted_queue() -> None:
    at_profile_cap = policy().choose(REQUEST, view(PROFILE_CAP, None), 0.0)  # type: ignore[attr-defined]
    larger = policy().choose(REQUEST, view(PROFILE_CAP, 64), 0.0)  # type: ignore[attr-defined]
    assert (
        larger.predicted_ttft_s["eagle"] < at_profile_cap.predicted_ttft_s["eagle"]
    )  # admitted at once: no queue wait


def test_an_outcome_teaches_at_the_batch_its_decision_assumed() -> None:
    """Calibration places an outcome at min(load + 1, cap): with the backend's reported cap (4)
    an outcome decided at load 30 teaches batch 4, not the profile's cap (48) or batch 31."""
    knows, blind = policy(), policy()
    knows.choose(REQUEST, view(30, 4), 0.0)  # type: ignore[attr-defined]
    blind.choose(REQUEST, view(30, None), 0.0)  # type: ignore[attr-defined]
    decision = Decision("eagle", "e", "faster_eagle", {}, {}, 30, "cost_model")
    for p in (knows, blind):
        for _ in range(40):  # decode at half the profile's speed at batch 4
            rate = KIMI.speed("eagle").decode_tok_s(4) / 2
            outcome = Outcome(replace(REQUEST), decision, 0.0, 0.1, 201, 0.1 + 200 / rate, "ok")
            p.observe(outcome)  # type: ignore[attr-defined]
    cal_k, cal_b = knows.calibration, blind.calibration  # type: ignore[attr-defined]
    assert cal_k.speed("eagle", 4) < 0.75  # learned at batch 4: about half the profile's speed
    assert cal_b.speed("eagle", 4) > cal_k.speed("eagle", 4)  # the blind one taught batch 31 instead


def test_an_outcome_of_n_sequences_teaches_the_batch_they_ran_at() -> None:
    """A request of 16 sequences (`n: 16`) decided at load 0 ran in a batch of 16: its decode rate,
    per sequence, teaches that batch, not batch 1, so an outcome at the profile's speed leaves
    the calibration where it was (issue 37, finding 2)."""
    p = policy()
    request = replace(REQUEST, sequences=16)
    decision = Decision("eagle", "e", "faster_eagle", {}, {}, 0, "cost_model")
    rate = KIMI.speed("eagle").decode_tok_s(16)  # per sequence, at batch 16
    for _ in range(40):
        p.observe(Outcome(request, decision, 0.0, 0.1, 16 * 201, 0.1 + 200 / rate, "ok"))  # type: ignore[attr-defined]
    cal = p.calibration  # type: ignore[attr-defined]
    assert cal.pool["eagle"].n == 40
    assert abs(cal.speed("eagle", 16) - 1.0) < 0.05 and abs(cal.speed("eagle", 1) - 1.0) < 0.05
