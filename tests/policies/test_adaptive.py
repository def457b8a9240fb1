"""The speed of an EAGLE-3 server adapting its draft depth (`policies.adaptive`), and what the
policies predict for a pair whose EAGLE-3 server adapts: never slower at high batch than the
plain server it falls back to."""

from __future__ import annotations

import pytest
from helpers import KIMI, Routed

from policies.adaptive import (
    AdaptiveSpeed,
    DepthModel,
    adaptive_mode,
    adaptive_profile,
    alpha_for,
    chain_accept_length,
)
from policies.base import BackendLoad, LoadView, PoolLoad, RequestInfo
from policies.ladder import SGLANG_DEFAULT, Ladder, from_vllm_schedule, parse_ladder
from policies.profile import Profile, ProfileError, resolve_profile
from policies.registry import PolicyContext, default_registry

LLAMA = resolve_profile("llama31-8b-h100-eagle3")
LADDERS = {
    "sglang": SGLANG_DEFAULT,
    "vllm": from_vllm_schedule([[1, 16, 3], [17, 48, 1], [49, 512, 0]]),
    "deep": parse_ladder("1:5,16:2,40:0"),
}


def test_accept_length_and_alpha_are_inverse() -> None:
    for alpha in (0.3, 0.66, 0.9):
        for steps in (1, 3, 7):
            assert alpha_for(chain_accept_length(alpha, steps), steps) == pytest.approx(alpha, abs=1e-9)
    assert chain_accept_length(0.5, 0) == 1.0
    assert alpha_for(1.0, 3) == 0.0 and alpha_for(9.0, 3) > 0.999


def test_what_is_assumed_is_named() -> None:
    kimi = DepthModel.of(KIMI.mode("eagle"))
    assert kimi.steps == 3 and kimi.assumed == ("speculative_num_steps 3",)
    assert chain_accept_length(kimi.alpha, 3) == pytest.approx(2.4)  # the profile's accept length
    llama = DepthModel.of(LLAMA.mode("eagle"))
    assert llama.assumed == ("speculative_num_steps 3",)
    assert chain_accept_length(llama.alpha, 3) == pytest.approx(2.77)  # the profile's accept length
    silent = DepthModel.of(KIMI.mode("eagle").model_copy(update={"accept_length": None}))
    assert silent.alpha == 0.7 and silent.assumed == ("speculative_num_steps 3", "accept_length 2.53")
    told = DepthModel.of(KIMI.mode("eagle").model_copy(update={"speculative_num_steps": 5}))
    assert told.steps == 5 and told.assumed == ()


@pytest.mark.parametrize("profile", [KIMI, LLAMA], ids=["kimi", "llama"])
def test_the_depth_model_is_exact_at_both_ends(profile: Profile) -> None:
    base, eagle = profile.speed("baseline"), profile.speed("eagle")
    speed = AdaptiveSpeed(base, eagle, DepthModel.of(profile.mode("eagle")))
    for b in (1, 10, 48, 100):
        assert speed.decode_tok_s(b, (0,)) == pytest.approx(base.decode_tok_s(b))
        assert speed.decode_tok_s(b, (3,)) == pytest.approx(eagle.decode_tok_s(b))
        assert speed.ttft_s(b, 0) == base.ttft_s(b) and speed.ttft_s(b, 3) == pytest.approx(eagle.ttft_s(b))
        # one step drafts less and costs less per step than three: between the two step times
        assert base.step_time(b) < speed.step_s(b, 1) < speed.step_s(b, 3)


@pytest.mark.parametrize("profile", [KIMI, LLAMA], ids=["kimi", "llama"])
@pytest.mark.parametrize("name", list(LADDERS))
def test_an_adaptive_server_is_never_predicted_slower_at_high_batch_than_its_plain_floor(
    profile: Profile, name: str
) -> None:
    """Where the ladder stops drafting the adaptive server decodes at the plain server's speed, for
    every request whatever its predicted acceptance, and cost_model predicts the pair's EAGLE-3
    server exactly as the plain one (given the same load and no prompt to prefill)."""
    ladder = LADDERS[name]
    assert ladder is not None
    off = ladder.off_from()
    assert off is not None
    adapted = adaptive_profile(profile, ladder, max_running_requests=256)
    plain, adaptive = profile.speed("baseline"), adapted.speed("eagle")
    assert adaptive.speculating is not None
    for b in [*range(off, off + 70), 250, 1000, 4096, 5000]:
        assert adaptive.decode_tok_s(b) == pytest.approx(plain.decode_tok_s(b), rel=1e-12), b
        assert adaptive.ttft_s(b) == pytest.approx(plain.ttft_s(b), rel=1e-12), b
        assert not adaptive.speculating[min(b, len(adaptive.speculating) - 1)]
    registry = default_registry(entry_points=False)
    for params in ({}, {"hint_speedup": {"prose": 0.5}, "calibrate": False}, {"scope": "request"}):
        policy = Routed(registry.create("cost_model", params, PolicyContext(adapted, 0)), 0)
        for b in (off - 1, off + 1, off + 40, 200):
            for hint in (None, "prose"):
                load = LoadView(
                    PoolLoad("baseline", (BackendLoad("b0", "baseline", running=b, queued=0),)),
                    PoolLoad("eagle", (BackendLoad("e0", "eagle", running=b, queued=0),)),
                )
                d = policy.choose(RequestInfo(max_tokens=300, hint=hint), load, 0.0)
                e, p = d.predicted_e2e_s["eagle"], d.predicted_e2e_s["baseline"]
                if b + 1 >= off:
                    assert e == pytest.approx(p, rel=1e-9), (params, b, hint)
                elif hint == "prose" and "hint_speedup" in params:
                    assert e > p  # drafting, a poorly accepted request is slower there


def test_below_the_floor_the_prediction_follows_the_depth() -> None:
    adapted = adaptive_profile(KIMI, SGLANG_DEFAULT).speed("eagle")
    eagle, plain = KIMI.speed("eagle"), KIMI.speed("baseline")
    assert adapted.decode_tok_s(1) == pytest.approx(eagle.decode_tok_s(1))  # 3 steps, as measured
    assert adapted.decode_tok_s(31) == pytest.approx(eagle.decode_tok_s(31))
    # 1 step from batch 32 on kimi: faster than its 3 measured steps, slower than plain (the
    # profile's EAGLE-3 step grows 2.1x as fast with the batch as the plain one)
    assert eagle.decode_tok_s(40) < adapted.decode_tok_s(40) < plain.decode_tok_s(40)
    assert [p.spec_steps for p in adaptive_profile(KIMI, SGLANG_DEFAULT).mode("eagle").points[30:34]] == [
        3.0, 1.0, 1.0, 1.0,
    ]  # fmt: skip
    assert adaptive_profile(KIMI, SGLANG_DEFAULT).mode("eagle").max_running_requests == 48
    # a cycle (0 and 1 step in turn): tokens over time of the two steps
    cycling = Ladder((SGLANG_DEFAULT.buckets[0], SGLANG_DEFAULT.buckets[2]))
    low = KIMI.mode("eagle").model_copy(update={"accept_length": 1.4})
    mode = adaptive_mode(KIMI.mode("baseline"), low, cycling)
    speed = AdaptiveSpeed(plain, KIMI.speed("eagle"), DepthModel.of(low))
    assert mode.points[39].spec_steps == 0.5
    assert mode.points[39].decode_tok_s == pytest.approx(
        (1 + speed.accept_length(1)) / (speed.step_s(40, 0) + speed.step_s(40, 1))
    )


def test_a_profile_without_both_modes_cannot_adapt() -> None:
    one = KIMI.model_copy(update={"modes": {"eagle": KIMI.mode("eagle")}})
    with pytest.raises(ProfileError, match="baseline"):
        adaptive_profile(one, SGLANG_DEFAULT)
