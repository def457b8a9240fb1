"""The simulator's engine against exact queueing results, and its determinism.

Processor sharing with a state-dependent service rate (Cohen's generalised processor
sharing) has a closed-form stationary distribution that does not depend on the service-time
distribution beyond its mean: with `n` requests in the system the server serves
`c(n) = n / t(n)` tokens per second in total, and `pi(n)` is proportional to
`(lambda * E[S])^n / prod_{k<=n} c(k)`. With `t(b) = c * b` (constant total rate) this is
M/M/1-PS, `E[T] = E[S] c / (1 - rho)`.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from policies.base import Decision, LoadView, Outcome, RequestInfo
from policies.profile import Profile, parse_profile, resolve_profile
from policies.registry import PolicyContext, default_registry
from simulator.engine.deployment import (
    DeploymentError,
    build_deployment,
    build_server,
    parse_adaptive,
    parse_deployment,
)
from simulator.engine.loop import FILLER, MEASURED, NOT_SENT, WARMUP, RequestBatch, SimulationError, simulate
from simulator.engine.runner import PolicyChoice, run
from simulator.engine.workloads import AcceptModel, LengthSpec, WorkloadSpec, generate


def linear_profile(a: float, c: float, *, cap: int | None = None, ttft: float = 0.0) -> Profile:
    """A one-mode (baseline) profile whose step time is exactly t(b) = a + c*b."""
    mode: dict[str, Any] = {
        "points": [
            {"concurrency": 1, "decode_tok_s": 1.0 / (a + c), "ttft_s": ttft},
            {"concurrency": 2, "decode_tok_s": 1.0 / (a + 2 * c), "ttft_s": ttft},
        ]
    }
    if cap is not None:
        mode["max_running_requests"] = cap
    return parse_profile({"format": "specroute.profile/v1", "name": "linear", "modes": {"baseline": mode}})


def measured_means(profile: Profile, rate: float, mean_tokens: float, n: int, seed: int) -> dict[str, float]:
    """Time-average number in system and mean response time, skipping the first 5% (warm-up)."""
    spec = WorkloadSpec(kind="poisson", rate=rate, requests=n, output_tokens=LengthSpec("exp", mean_tokens))
    seg = generate(spec, seed)[0]
    servers = build_deployment(profile, parse_deployment("baseline=1"))
    raw = simulate(servers, None, seg.batch, seed=seed)
    work = [max(k - 1, 0) for k in seg.batch.output_tokens]
    skip = n // 20
    t0, t1 = raw.arrival[skip], raw.arrival[-1]
    area = 0.0
    for a, f in zip(raw.arrival, raw.finish, strict=True):
        lo, hi = max(a, t0), min(f, t1)
        if hi > lo:
            area += hi - lo
    e2e = [f - a for a, f in zip(raw.arrival[skip:], raw.finish[skip:], strict=True)]
    return {
        "mean_n": area / (t1 - t0),
        "mean_t": math.fsum(e2e) / len(e2e),
        "mean_work": math.fsum(work) / len(work),
    }


def cohen_mean_n(rate: float, mean_work: float, a: float, c: float) -> float:
    """E[N] of generalised processor sharing with c(k) = k / (a + c k) tokens/s."""
    weights = [1.0]
    for k in range(1, 20000):
        weights.append(weights[-1] * rate * mean_work * (a + c * k) / k)
        if weights[-1] < 1e-14 * max(weights):
            break
    total = math.fsum(weights)
    return math.fsum(k * w for k, w in enumerate(weights)) / total


def test_generalised_processor_sharing_matches_cohen() -> None:
    a, c, rate, mean_tokens = 0.01, 0.002, 6.0, 51.0
    got = measured_means(linear_profile(a, c), rate, mean_tokens, 300_000, seed=7)
    expect_n = cohen_mean_n(rate, got["mean_work"], a, c)
    expect_t = expect_n / rate  # Little's law
    assert got["mean_n"] == pytest.approx(expect_n, rel=0.03)
    assert got["mean_t"] == pytest.approx(expect_t, rel=0.03)


def test_constant_total_rate_is_mm1_ps() -> None:
    c, rate, mean_tokens = 0.002, 6.0, 51.0
    got = measured_means(linear_profile(0.0, c), rate, mean_tokens, 400_000, seed=11)
    rho = rate * got["mean_work"] * c
    expect_t = got["mean_work"] * c / (1.0 - rho)
    assert 0.55 < rho < 0.65
    assert got["mean_t"] == pytest.approx(expect_t, rel=0.03)
    assert got["mean_n"] == pytest.approx(rho / (1.0 - rho), rel=0.03)


def _batch(outputs: list[int], arrivals: list[float] | None = None) -> RequestBatch:
    n = len(outputs)
    return RequestBatch([0] * n, outputs, list[int | None](outputs), [None] * n, [1.0] * n, arrivals)


def test_single_request_timing_follows_profile() -> None:
    profile = linear_profile(0.01, 0.001, ttft=0.5)
    servers = build_deployment(profile, parse_deployment("baseline=1"))
    raw = simulate(servers, None, _batch([101], [2.0]))
    assert raw.first_token[0] == pytest.approx(2.5)
    assert raw.finish[0] == pytest.approx(2.5 + 100 * 0.011)


def test_requests_beyond_the_cap_wait_fifo() -> None:
    profile = linear_profile(0.01, 0.0, cap=2)  # constant 100 tok/s per request
    servers = build_deployment(profile, parse_deployment("baseline=1"))
    raw = simulate(servers, None, _batch([101, 201, 101, 101], [0.0, 0.0, 0.1, 0.2]))
    assert raw.finish[0] == pytest.approx(1.0)
    assert raw.finish[1] == pytest.approx(2.0)
    # The third request starts when the first leaves, the fourth when the third leaves.
    assert raw.first_token[2] == pytest.approx(1.0)
    assert raw.finish[2] == pytest.approx(2.0)
    assert raw.first_token[3] == pytest.approx(2.0)
    assert raw.finish[3] == pytest.approx(3.0)


def test_processor_sharing_slows_every_request_in_the_batch() -> None:
    a, c = 0.01, 0.01  # t(1) = 0.02, t(2) = 0.03
    servers = build_deployment(linear_profile(a, c), parse_deployment("baseline=1"))
    raw = simulate(servers, None, _batch([101, 101], [0.0, 0.0]))
    assert raw.finish[0] == pytest.approx(100 * 0.03)
    # A request joining half-way runs at the batch-of-2 rate until the first one leaves.
    raw = simulate(servers, None, _batch([101, 101], [0.0, 1.0]))
    # first: 1 s alone (50 tokens), then 50 tokens at 0.03 s -> leaves at 2.5 s
    assert raw.finish[0] == pytest.approx(2.5)
    # second: 50 tokens by 2.5 s (at 0.03), then 50 alone at 0.02 -> 3.5 s
    assert raw.finish[1] == pytest.approx(3.5)


def test_eagle_acceptance_factor_scales_decode_time() -> None:
    profile = resolve_profile("kimi-k25-int4-8gpu")
    servers = build_deployment(profile, parse_deployment("eagle=1"))
    fast = RequestBatch([0], [201], [201], [None], [2.0], [0.0])
    slow = RequestBatch([0], [201], [201], [None], [1.0], [0.0])
    d_fast = simulate(servers, None, fast)
    d_slow = simulate(servers, None, slow)
    decode_fast = d_fast.finish[0] - d_fast.first_token[0]
    decode_slow = d_slow.finish[0] - d_slow.first_token[0]
    assert decode_fast == pytest.approx(decode_slow / 2)


def test_closed_loop_keeps_concurrency_clients() -> None:
    servers = build_deployment(linear_profile(0.01, 0.0), parse_deployment("baseline=1"))
    raw = simulate(servers, None, _batch([101] * 9), concurrency=3)
    assert sorted(raw.finish) == pytest.approx([1.0] * 3 + [2.0] * 3 + [3.0] * 3)


def test_closed_loop_phases_follow_the_bench_rule() -> None:
    """Warm-up until `warmup` have completed, then `measure` measured, fillers until they finish."""
    servers = build_deployment(linear_profile(0.01, 0.0), parse_deployment("baseline=1"))
    raw = simulate(servers, None, _batch([101] * 12), concurrency=3, warmup=2, measure=4)
    assert raw.phase == [WARMUP] * 4 + [MEASURED] * 4 + [FILLER] * 2 + [NOT_SENT] * 2
    assert raw.arrival[4:8] == [1.0, 1.0, 2.0, 2.0]  # each measured request runs with 3 in flight


def test_policy_routes_and_learns_through_the_same_types() -> None:
    profile = resolve_profile("kimi-k25-int4-8gpu")
    spec = WorkloadSpec(kind="sweep", levels=(1, 70), requests_per_level=70)
    result = run(
        profile,
        PolicyChoice("threshold", {"threshold": 4}),
        parse_deployment("baseline=1,eagle=1"),
        generate(spec, 3),
        seed=3,
    )
    assert result.levels is not None
    low, high = result.levels
    assert low["pool_share"]["eagle"] == 1.0  # alone, always eagle
    # under load mostly baseline (the level's 70 simultaneous starts queue for prefill at first)
    assert high["pool_share"]["baseline"] > 0.7


def test_online_policy_observes_outcomes() -> None:
    profile = resolve_profile("kimi-k25-int4-8gpu")
    names = default_registry().names()
    if "online" not in names:
        pytest.skip("online policy not registered")
    policy = default_registry().create("online", {}, PolicyContext(profile, 1))
    seen: list[float] = []
    observe = policy.observe

    class Recording:
        name = policy.name

        def choose(self, request, view, now):  # type: ignore[no-untyped-def]
            return policy.choose(request, view, now)

        def observe(self, outcome):  # type: ignore[no-untyped-def]
            seen.append(outcome.duration_s)
            observe(outcome)

    seg = generate(WorkloadSpec(kind="poisson", rate=5, requests=200), 1)[0]
    servers = build_deployment(profile, parse_deployment("baseline=1,eagle=1"))
    raw = simulate(servers, Recording(), seg.batch, seed=1)  # type: ignore[arg-type]
    assert len(seen) == 200
    assert sorted(seen) == pytest.approx(sorted(f - a for a, f in zip(raw.arrival, raw.finish, strict=True)))


def test_same_seed_same_result_different_seed_different_workload() -> None:
    profile = resolve_profile("kimi-k25-int4-8gpu")
    spec = WorkloadSpec(kind="poisson", rate=8, requests=3000, output_tokens=LengthSpec("exp", 150))
    dep = parse_deployment("baseline=1,eagle=1")
    one = run(profile, PolicyChoice("threshold"), dep, generate(spec, 5), seed=5).to_json()
    two = run(profile, PolicyChoice("threshold"), dep, generate(spec, 5), seed=5).to_json()
    other = run(profile, PolicyChoice("threshold"), dep, generate(spec, 6), seed=6).to_json()
    assert one == two
    assert one != other


def test_policy_choosing_an_unknown_backend_is_a_clear_error() -> None:
    profile = resolve_profile("kimi-k25-int4-8gpu")
    inner = default_registry().create("fixed", {}, PolicyContext(profile, 0))

    class Wrong:
        name = "wrong"

        def choose(self, request, view, now):  # type: ignore[no-untyped-def]
            d = inner.choose(request, view, now)
            return type(d)(pool=d.pool, backend="nowhere", reason="x")

        def observe(self, outcome):  # type: ignore[no-untyped-def]
            pass

    servers = build_deployment(profile, parse_deployment("baseline=1,eagle=1"))
    with pytest.raises(SimulationError, match="nowhere"):
        simulate(servers, Wrong(), _batch([10], [0.0]))  # type: ignore[arg-type]


def test_adaptive_server_follows_its_ladder() -> None:
    """SGLang's default ladder on the kimi profile: the EAGLE-3 speed while it drafts as deep as
    the profile was measured (3 steps below batch 32), the plain speed from batch 64, 1 step
    between (derived: neither measured curve)."""
    profile = resolve_profile("kimi-k25-int4-8gpu")
    base, eagle = profile.speed("baseline"), profile.speed("eagle")
    adaptive = build_server(profile, "adaptive", "adaptive-0")
    assert adaptive.pool == "eagle"
    assert adaptive.max_running_requests == base.max_running_requests
    for b in (1, 7, 8, 31):
        assert adaptive.rate_at(b) == pytest.approx(eagle.decode_tok_s(b))
    for b in (64, 100, 250, 1000, 5000):
        assert adaptive.rate_at(b) == pytest.approx(base.decode_tok_s(b))
    assert eagle.decode_tok_s(40) < adaptive.rate_at(40) != pytest.approx(base.decode_tok_s(40))
    assert adaptive.drafting is not None and adaptive.drafting[63] and not adaptive.drafting[64]
    # a vLLM schedule: fixed depths, 0 from batch 17 on
    custom = build_server(profile, "adaptive", "a", parse_adaptive("[[1,16,3],[17,512,0]]"))
    assert custom.rate_at(16) == pytest.approx(eagle.decode_tok_s(16))
    assert custom.rate_at(17) == pytest.approx(base.decode_tok_s(17))


def test_deployment_and_ladder_specs() -> None:
    assert parse_deployment("baseline=2, adaptive=1") == (("baseline", 2), ("adaptive", 1))
    for bad in ("baseline", "baseline=x", "baseline=-1", "eagle=1,eagle=2", "baseline=0", "gpu=1"):
        with pytest.raises(DeploymentError):
            parse_deployment(bad)
    assert parse_adaptive("1:3,64:0").describe() == "1:3,64:0"
    for bad in ("8", "8:x", "32:1,8:0", "0:1", "off", "[[2,8,3]]", "1:99", "/nonexistent/ladder.json"):
        with pytest.raises(DeploymentError, match="--adaptive-ladder"):
            parse_adaptive(bad)


def _eagle_rates_by_hint(
    policy: Any = None, hints_seen: bool = True, deployment: str = "eagle=1"
) -> dict[str | None, set[float]]:
    """Decode rates of a hinted sweep's measured requests (all sent to EAGLE), by true hint."""
    spec = WorkloadSpec(
        kind="sweep",
        levels=(1,),
        requests_per_level=40,
        hint_mix={"code": 1.0, "prose": 1.0},
        accept=AcceptModel(hint_factor={"code": 1.25, "prose": 0.8}),
        hints_seen=hints_seen,
    )
    seg = generate(spec, 2)[0]
    servers = build_deployment(resolve_profile("kimi-k25-int4-8gpu"), parse_deployment(deployment))
    raw = simulate(servers, policy, seg.batch, concurrency=1, warmup=0, measure=40)
    rates: dict[str | None, set[float]] = {}
    for i, ph in enumerate(raw.phase):
        if ph == MEASURED:
            rate = (seg.batch.output_tokens[i] - 1) / (raw.finish[i] - raw.first_token[i])
            rates.setdefault(seg.batch.hints[i], set()).add(round(rate, 6))
    return rates


HINTED_RATES = {"code": {round(96.1 * 1.25, 6)}, "prose": {round(96.1 * 0.8, 6)}}


def test_hint_acceptance_factors_reach_eagle_requests() -> None:
    assert _eagle_rates_by_hint() == HINTED_RATES


def test_unsorted_open_loop_arrivals_are_rejected() -> None:
    servers = build_deployment(linear_profile(0.01, 0.0), parse_deployment("baseline=1"))
    with pytest.raises(SimulationError, match="sorted"):
        simulate(servers, None, _batch([10, 10], [1.0, 0.5]))


def test_prefill_cost_when_the_profile_gives_it() -> None:
    profile = parse_profile(
        {
            "format": "specroute.profile/v1",
            "modes": {
                "baseline": {
                    "prefill_tok_s": 1000.0,
                    "points": [{"concurrency": 1, "decode_tok_s": 100.0, "ttft_s": 0.1}],
                }
            },
        }
    )
    servers = build_deployment(profile, parse_deployment("baseline=1"))
    batch = RequestBatch([2000], [11], [11], [None], [1.0], [0.0])
    raw = simulate(servers, None, batch)
    assert raw.first_token[0] == pytest.approx(0.1 + 2.0)
    assert raw.finish[0] == pytest.approx(2.1 + 0.1)


def test_goodput_counts_requests_meeting_both_slos_per_second() -> None:
    from simulator.engine.results import Samples, Slo, goodput

    def part(ttft: list[float], tpot: list[float | None], makespan: float) -> Samples:
        n = len(ttft)
        return Samples(ttft, [1.0] * n, [50.0] * n, tpot, 100.0 * n, makespan, {"baseline": n})

    a = part([0.1, 0.5, 0.2, 0.1], [0.01, 0.01, 0.10, None], 10.0)  # None: a one-token answer
    b = part([0.1], [0.02], 10.0)
    # both SLOs: requests 1 and 4 of a, and b's -> 3 over 20 s
    assert goodput([a, b], Slo(ttft_s=0.3, tpot_s=0.05)) == pytest.approx(3 / 20)
    assert goodput([a, b], Slo(ttft_s=0.3)) == pytest.approx(4 / 20)  # an unset SLO always holds
    assert goodput([a, b], Slo(tpot_s=0.05)) == pytest.approx(4 / 20)
    assert goodput([a], Slo()) == pytest.approx(4 / 10)


def test_hidden_hints_set_what_requests_are_but_the_policy_does_not_see_them() -> None:
    """`--hints-hidden`: each request keeps its hint's acceptance, the policy gets `hint=None` (as
    when clients do not send x-specroute-hint)."""
    seen: list[str | None] = []

    class Recording:
        name = "recording"

        def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
            seen.append(request.hint)
            return Decision(pool="eagle", backend=view.eagle.backends[0].name, reason="test")

        def observe(self, outcome: Outcome) -> None:
            pass

    for hidden in (False, True):
        seen.clear()
        rates = _eagle_rates_by_hint(Recording(), hints_seen=not hidden, deployment="baseline=1,eagle=1")
        assert rates == HINTED_RATES
        assert set(seen) == ({None} if hidden else {"code", "prose"})
