"""`policies.acceptance` and cost_model's content hook: the eagle speed factor of a request is
learned from what it asks; unsure or content-independent traffic falls back to the pool average;
deterministic, bounded; content_aware=false is today's behaviour."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
from helpers import Routed

from policies.acceptance import AcceptanceModel
from policies.base import BackendLoad, Decision, LoadView, Outcome, PoolLoad, RequestFeatures, RequestInfo
from policies.features import TRAIT_BITS, extract_features
from policies.profile import resolve_profile
from policies.registry import PolicyContext, default_registry

KIMI = resolve_profile("kimi-k25-int4-8gpu")
ACCEPT = KIMI.mode("eagle").accept_length or 1.0
WORDS = {
    "code": "def return import class lambda yield self print list dict int str for while".split(),
    "prose": "explain the history river poem story describe friendly why people world".split(),
}


def prompt(kind: str, rng: random.Random) -> RequestFeatures:
    words = [rng.choice(WORDS[kind]) for _ in range(12)] + [f"x{rng.randrange(10**6)}" for _ in range(4)]
    return extract_features({"messages": [{"role": "user", "content": " ".join(words)}]}, "chat")


def test_learns_per_content_factors_to_a_few_percent() -> None:
    rng = random.Random(1)
    m = AcceptanceModel()
    truth = {"code": math.log(1.5), "prose": math.log(0.8)}
    for _ in range(400):
        kind = rng.choice(("code", "prose"))
        m.learn(prompt(kind, rng), None, truth[kind] + rng.gauss(0, 0.05), 0.0)
    for kind, y in truth.items():
        errors = [abs(math.exp(m.predict(prompt(kind, rng), None, 0.0) - y) - 1) for _ in range(50)]
        assert sorted(errors)[25] < 0.06, kind


def test_learns_that_acceptance_falls_with_temperature() -> None:
    """The same prompts sampled hot and cold: the parameters' own weights carry the difference."""
    rng = random.Random(6)
    texts = [" ".join(rng.choice(WORDS["prose"]) for _ in range(12)) + f" q{i}" for i in range(200)]

    def feats(i: int, t: float) -> RequestFeatures:
        return extract_features(
            {"messages": [{"role": "user", "content": texts[i]}], "temperature": t}, "chat"
        )

    m = AcceptanceModel()
    for _ in range(600):
        t = rng.choice((0.0, 1.0))
        m.learn(feats(rng.randrange(200), t), None, 0.0 if t == 0.0 else math.log(0.6), -0.2)
    cold = [math.exp(m.predict(feats(i, 0.0), None, -0.2)) for i in range(0, 200, 10)]
    hot = [math.exp(m.predict(feats(i, 1.0), None, -0.2)) for i in range(0, 200, 10)]
    assert abs(sum(cold) / len(cold) - 1.0) < 0.03
    assert abs(sum(hot) / len(hot) - 0.6) < 0.03


def test_unknown_or_content_independent_traffic_is_predicted_at_the_fallback() -> None:
    rng = random.Random(2)
    fresh = AcceptanceModel()
    assert fresh.predict(prompt("code", rng), None, 0.3) == 0.3  # nothing learned: the pool average
    m = AcceptanceModel()
    for _ in range(400):  # acceptance that does not depend on content: noise around the fallback
        m.learn(prompt(rng.choice(("code", "prose")), rng), None, rng.gauss(0.1, 0.1), 0.1)
    preds = [m.predict(prompt(k, rng), None, 0.1) for k in ("code", "prose") for _ in range(20)]
    assert max(abs(p - 0.1) for p in preds) < 0.05


SHARED = "the a of and to in is what it for".split()
"""Words every kind of request uses."""
KINDS = {"other": "solve compute total how many price each left".split(), **WORDS}


def kind_prompt(kind: str, rng: random.Random) -> RequestFeatures:
    text = [rng.choice(KINDS[kind]) for _ in range(8)] + rng.sample(SHARED, 5) + [f"x{rng.randrange(10**6)}"]
    return extract_features({"messages": [{"role": "user", "content": " ".join(text)}]}, "chat")


def selected_run(truth: dict[str, float], send: dict[str, float], n: int) -> tuple[AcceptanceModel, float]:
    """Traffic of equal shares of `truth`'s kinds (their words plus words they all share), each
    request predicted, and sent to EAGLE (where its outcome teaches) with its kind's probability
    in `send`; the fallback is the mean of what was sent, as the calibration keeps it. Returns the
    model and that fallback."""
    rng = random.Random(10)
    m, sent, total = AcceptanceModel(), 0, 0.0
    for _ in range(n):
        kind = rng.choice(list(truth))
        f = kind_prompt(kind, rng)
        fallback = total / sent if sent else 0.0
        m.predict_spread(f, None, fallback, sent, selected=True)
        if rng.random() < send[kind]:
            y = math.log(truth[kind]) + rng.gauss(0, 0.05)
            m.learn(f, None, y, fallback, selected=True)
            sent, total = sent + 1, total + y
    return m, total / sent


def test_a_rarely_sent_kind_is_learned_and_the_fallback_is_the_traffics() -> None:
    """Issue 33: the router sends code to EAGLE nearly always and prose rarely, so the pool average
    of what was sent is mostly code's. Corrected by `shift`, the fallback is the traffic's average
    (what a content-blind router's sample would average), and prose's few outcomes teach its words
    its factor although the words it shares with every kind are pulled toward the others'."""
    truth = {"code": 1.5, "prose": 0.7, "other": 1.0}
    m, pooled = selected_run(truth, {"code": 0.95, "prose": 0.2, "other": 0.4}, 600)
    traffic = sum(math.log(f) for f in truth.values()) / len(truth)
    assert pooled - traffic > 0.1  # the outcomes' average is biased toward code's
    assert abs(pooled + m.shift - traffic) < 0.05, (pooled, m.shift, traffic)
    rng = random.Random(11)
    for kind, factor in truth.items():
        got = [math.exp(m.predict(kind_prompt(kind, rng), None, pooled, selected=True)) for _ in range(20)]
        # within 12%: prose shares its trait set (none) with "other", so its kind's offset is
        # theirs; over 12 seeds of this run prose's median error is +10% (+10% before the kinds'
        # offsets too), against +17-24% before `shift` and the mean-then-EWMA token weights
        assert abs(statistics.median(got) / factor - 1) < 0.12, (kind, got)
    # predicting does not change what is predicted: the correction moves when an outcome teaches
    probe = kind_prompt("prose", rng)
    first = m.predict_spread(probe, None, pooled, 100.0, selected=True)[0]
    for _ in range(50):
        m.predict_spread(kind_prompt("code", rng), None, pooled, 100.0, selected=True)
    assert m.predict_spread(probe, None, pooled, 100.0, selected=True)[0] == first
    # a request of words never taught is predicted at the corrected fallback
    novel = " ".join(f"novel{k}" for k in range(60))
    unseen = extract_features({"messages": [{"role": "user", "content": novel}]}, "chat")
    assert m.predict(unseen, None, pooled, selected=True) == pytest.approx(pooled + m.shift, abs=0.01)
    # routing that does not depend on content (or acceptance that does not): nothing to correct
    even, _ = selected_run(truth, {"code": 0.5, "prose": 0.5, "other": 0.5}, 600)
    flat, _ = selected_run(
        {"code": 1.0, "prose": 1.0, "other": 1.0}, {"code": 0.95, "prose": 0.2, "other": 0.4}, 600
    )
    assert abs(even.shift) < 0.03 and abs(flat.shift) < 0.01, (even.shift, flat.shift)


COMMON = "the and of to is are for with that this it be by at from what how which you your".split()


def known_kind(kind: str, rng: random.Random) -> RequestFeatures:
    words = [rng.choice(WORDS[kind] + COMMON) for _ in range(16)] + [f"x{rng.randrange(10**6)}"]
    return extract_features({"messages": [{"role": "user", "content": " ".join(words)}]}, "chat")


def new_kind(rng: random.Random) -> RequestFeatures:
    """Sums never seen: common words, new ones, and math notation (the `math` trait)."""
    words = " ".join(rng.choice(COMMON) if i % 2 else f"n{rng.randrange(10**9)}" for i in range(16))
    text = f"{words} ${rng.randrange(10**6)}+{rng.randrange(10**6)}$"
    return extract_features({"messages": [{"role": "user", "content": text}]}, "chat")


def test_a_new_kinds_trait_learns_it_so_the_known_kinds_stay_put() -> None:
    """Issue 33: a kind never seen in training (its words new, its trait never taught) arrives
    faster than every known kind. Its trait learns at the text's rate, so its first outcomes teach
    the trait its offset instead of moving the common level every prediction shares: the kinds
    already known stay nearer their factors than with traits learning at `param_rate`."""
    assert new_kind(random.Random(0)).traits & TRAIT_BITS["math"]
    truth = {"code": 1.5, "prose": 0.8}
    fallback = math.log(1.1)

    def errors(trait_rate: float) -> tuple[float, float]:
        """(known kinds' mean |predicted / factor - 1|, the new kind's), over 5 seeds."""
        known, new = [], []
        for seed in range(5):
            rng = random.Random(seed)
            m = AcceptanceModel(trait_rate=trait_rate)
            for _ in range(400):
                kind = rng.choice(("code", "prose"))
                m.learn(known_kind(kind, rng), None, math.log(truth[kind]) + rng.gauss(0, 0.05), fallback)
            for _ in range(20):
                m.learn(new_kind(rng), None, math.log(1.3) + rng.gauss(0, 0.05), fallback)
            for kind, factor in truth.items():
                got = [math.exp(m.predict(known_kind(kind, rng), None, fallback)) for _ in range(30)]
                known.append(abs(statistics.median(got) / factor - 1))
            got = [math.exp(m.predict(new_kind(rng), None, fallback)) for _ in range(30)]
            new.append(abs(statistics.median(got) / 1.3 - 1))
        return statistics.fmean(known), statistics.fmean(new)

    # with the new kind's own offset (its trait set's), measured: known 0.087 / 0.100 and new
    # 0.026 / 0.023 at 0.1 / 0.03; before it, known 0.132 / 0.179 and new 0.071 / 0.070
    text_rate, param_rate = errors(0.1), errors(0.03)
    assert text_rate[0] < param_rate[0] - 0.01, (text_rate, param_rate)
    assert text_rate[1] <= param_rate[1] + 0.01, (text_rate, param_rate)
    assert text_rate[0] < 0.11 and text_rate[1] < 0.04, text_rate


def test_deterministic_and_bounded() -> None:
    def run() -> list[float]:
        rng = random.Random(3)
        m = AcceptanceModel(dim=256, max_families=8)
        out = []
        for i in range(300):
            f = RequestFeatures(family=i + 1, grams=tuple(rng.randrange(2**32) for _ in range(20)))
            m.learn(f, "h", rng.gauss(0, 0.3), 0.0)
            out.append(m.predict(f, "h", 0.0))
        assert m.families == 8
        return out

    assert run() == run()
    assert AcceptanceModel().predict(RequestFeatures(), None, 10.0) == 10.0  # nothing learned
    m = AcceptanceModel()
    f = RequestFeatures(grams=(1, 2))
    for _ in range(50):
        m.learn(f, None, 50.0, 0.0)  # an absurd target is clipped
        m.learn(f, None, float("nan"), 0.0)  # and a non-number ignored
    assert m.predict(f, None, 0.0) <= math.log(4.0)


# --- through cost_model ------------------------------------------------------------------


def cost_model(**params: object) -> Routed:
    registry = default_registry(entry_points=False)
    return Routed(registry.create("cost_model", params, PolicyContext(KIMI, 0)), 0)


def idle() -> LoadView:
    return LoadView(
        PoolLoad("baseline", (BackendLoad("b0", "baseline", running=8, queued=0),)),
        PoolLoad("eagle", (BackendLoad("e0", "eagle", running=8, queued=0),)),
    )


def teach(policy: Routed, info: RequestInfo, factor: float, *, spec: bool) -> Decision:
    d = policy.choose(info, idle(), 0.0)
    rate = factor / KIMI.speed("eagle").step_time(9)  # the profile's eagle rate at 9 running x factor
    n = 201
    out = Outcome(
        info,
        Decision("eagle", "e0", "faster_eagle", backend_load=8),
        0.0,
        0.1,
        n,
        0.1 + (n - 1) / rate,
        "ok",
        ACCEPT * factor if spec else None,
    )
    policy.observe(out)
    return d


def test_cost_model_learns_the_factor_from_spec_details_and_from_timing() -> None:
    rng = random.Random(4)
    for spec in (True, False):
        policy = cost_model()
        truth = {"code": 1.5, "prose": 0.8}
        for _ in range(300):
            kind = rng.choice(("code", "prose"))
            teach(policy, RequestInfo(max_tokens=200, features=prompt(kind, rng)), truth[kind], spec=spec)
        for kind, factor in truth.items():
            d = policy.choose(RequestInfo(max_tokens=200, features=prompt(kind, rng)), idle(), 0.0)
            assert d.accept_factor is not None and abs(d.accept_factor / factor - 1) < 0.08, (spec, kind)
        # the prediction drives the decision: code where eagle is fast, prose where it is slow
        e_code = policy.choose(RequestInfo(max_tokens=200, features=prompt("code", rng)), idle(), 0.0)
        e_prose = policy.choose(RequestInfo(max_tokens=200, features=prompt("prose", rng)), idle(), 0.0)
        assert e_code.predicted_e2e_s["eagle"] < e_prose.predicted_e2e_s["eagle"]


def test_content_aware_false_is_content_blind() -> None:
    rng = random.Random(5)
    aware, blind = cost_model(), cost_model(content_aware=False)
    for _ in range(100):
        info = RequestInfo(max_tokens=200, features=prompt("code", rng))
        teach(aware, info, 1.5, spec=True)
        d = teach(blind, info, 1.5, spec=True)
        assert d.accept_factor is None
    assert blind.policy.content is None  # type: ignore[attr-defined]
    # requests without features (traces, synthetic workloads) are routed as before
    plain = cost_model()
    info = RequestInfo(max_tokens=200)
    assert (
        plain.choose(info, idle(), 0.0).predicted_e2e_s
        == cost_model(content_aware=False).choose(info, idle(), 0.0).predicted_e2e_s
    )


# --- what was learned survives a restart (i34b's state file calls these) --------------------------


def test_state_round_trips_exactly_through_json() -> None:
    rng = random.Random(8)
    policy = cost_model()
    truth = {"code": 1.5, "prose": 0.8}
    for i in range(200):
        kind = rng.choice(("code", "prose"))
        info = RequestInfo(max_tokens=200, features=prompt(kind, rng), client=i % 3)
        teach(policy, info, truth[kind], spec=True)
    saved = json.loads(json.dumps(policy.policy.state()))  # type: ignore[attr-defined]
    assert set(saved) == {"version", "calibration", "content", "explore"}
    fresh = cost_model()
    fresh.policy.load_state(saved)  # type: ignore[attr-defined]
    assert json.loads(json.dumps(fresh.policy.state())) == saved  # type: ignore[attr-defined]
    probes = [RequestInfo(max_tokens=200, features=prompt(k, random.Random(i))) for i, k in enumerate(truth)]
    for info in probes:  # the restored policy predicts what the original does
        a, b = policy.choose(info, idle(), 0.0), fresh.choose(info, idle(), 0.0)
        assert a.accept_factor == b.accept_factor and a.accept_factor is not None
    # a state that does not fit is refused whole, the model unchanged
    small = AcceptanceModel(dim=256)
    with pytest.raises(ValueError, match="other dimensions"):
        small.load_state(saved["content"])
    with pytest.raises(ValueError, match="layout version 1"):
        small.load_state({"version": 1})
    with pytest.raises(ValueError, match="cost_model: explore was on"):
        cost_model(explore_budget=0).policy.load_state(saved)  # type: ignore[attr-defined]
    broken = json.loads(json.dumps(saved["content"]))
    broken["client_offsets"] = saved["content"]["client_recent"][:-4]  # one value short
    model = AcceptanceModel()
    with pytest.raises(ValueError, match="8-byte values"):
        model.load_state(broken)
    assert model.taught == 0


# --- one client cannot move what everyone shares (issue 37, finding 1) ----------------------------


def test_one_client_cannot_move_a_shared_family_far() -> None:
    """Many clients teach one family (the same system prompt) its true factor; then one client sends
    hundreds of absurd outcomes (a slow reader's requests look 4x slow) while the others' keep
    coming at a tenth of its rate (what exploration keeps sending to EAGLE). The prediction for
    everyone stays near the truth, and every outcome moves it by a bounded step."""
    rng = random.Random(9)
    system = "You are a helpful assistant."

    def ask(i: int) -> RequestFeatures:
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i} x"}]}
        return extract_features(body, "chat")

    m = AcceptanceModel()
    for i in range(300):  # ten clients, true factor 1.2
        m.learn(ask(i), None, math.log(1.2) + rng.gauss(0, 0.03), 0.0, client=100 + i % 10)
    before = math.exp(m.predict(ask(10_000), None, 0.0))
    assert abs(before / 1.2 - 1) < 0.05
    step = []
    for i in range(300):
        m.learn(ask(20_000 + i), None, math.log(0.25), 0.0, client=666)
        step.append(math.exp(m.predict(ask(10_000), None, 0.0)))
        if i % 10 == 9:
            m.learn(ask(30_000 + i), None, math.log(1.2) + rng.gauss(0, 0.03), 0.0, client=100 + i % 7)
    assert step[0] / before > 0.92  # one absurd outcome moves it a bounded step
    assert min(step) / before > 0.8, (before, min(step))  # its first outcomes, up to an equal share
    assert abs(step[-1] / 1.2 - 1) < 0.1
    # the same outcomes from the family's only client are learned: a real change is followed
    alone = AcceptanceModel()
    for i in range(300):
        alone.learn(ask(i), None, math.log(1.2), 0.0, client=1)
    for i in range(300):
        alone.learn(ask(20_000 + i), None, math.log(0.5), 0.0, client=1)
    assert abs(math.exp(alone.predict(ask(10_000), None, 0.0)) / 0.5 - 1) < 0.1


def test_a_kind_never_trained_on_is_learned_from_a_few_outcomes_of_it() -> None:
    """Issue 33, held-out task types: a kind of request that training never had (math, here
    faster on EAGLE than every kind trained on) arrives with words never seen, each prompt its
    own. Its trait set keeps a running mean of what the rest of the model misses for it, which
    is evidence that a request of that kind is known however new its words: after 20 of its
    outcomes, its never-seen prompts are predicted within 3% of its factor, not shrunk toward
    the pool average (6% short without the kind's offset)."""

    def request(kind: str, rng: random.Random) -> RequestFeatures:
        head = {"summ": "summarize: ", "ext": "extract the names: ", "math": f"how many {rng.randrange(99)} "}
        words = rng.sample(SHARED, 4) + [f"{kind}{rng.randrange(10**6)}" for _ in range(10)]
        content = head[kind] + " ".join(words)
        return extract_features({"messages": [{"role": "user", "content": content}]}, "chat")

    truth = {"summ": math.log(0.9), "ext": 0.0, "math": math.log(1.27)}
    assert request("math", random.Random(0)).traits == TRAIT_BITS["math"]
    errors = []
    for seed in range(4):
        rng = random.Random(seed)
        m = AcceptanceModel()
        for _ in range(300):
            kind = rng.choice(("summ", "ext"))
            m.learn(request(kind, rng), None, truth[kind] + rng.gauss(0, 0.03), -0.05)
        for _ in range(20):
            m.learn(request("math", rng), None, truth["math"] + rng.gauss(0, 0.03), -0.05)
        got = [m.predict(request("math", rng), None, -0.05) for _ in range(30)]
        errors.append(statistics.fmean(got) - truth["math"])
    assert abs(statistics.fmean(errors)) < 0.03, errors
