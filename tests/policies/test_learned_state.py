"""What a policy learned, as plain data (`policies.learned`): the calibration, the content model,
the prefix index and `cost_model` save their state, load it through JSON into a fresh object and
then predict -- and go on learning -- exactly as the saved one; data they cannot take is refused
with a StateError and leaves them as they were."""

from __future__ import annotations

import copy
import json
import math
import random
from typing import Any

import pytest

from policies.acceptance import AcceptanceModel
from policies.calibration import SpeedCalibration
from policies.features import extract_features
from policies.learned import StateError, learner, pack, unpack
from policies.prefix import PrefixIndex
from policies.profile import resolve_profile
from policies.registry import default_registry
from policies.spec import PolicyContext

BOUNDS = [1, 4, 16, 64]


def _calibration() -> SpeedCalibration:
    return SpeedCalibration(
        BOUNDS, window=50, prior_weight=10, clip=1.5, max_hints=3, hint_idle=20,
        hint_priors={"code": 1.2}, accept_length=3.0,
    )  # fmt: skip


def _through_json(state: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(state, allow_nan=False))
    return loaded


def _teach_calibration(cal: SpeedCalibration, rng: random.Random, n: int, *, slow: float = 1.0) -> None:
    for _ in range(n):
        pool = rng.choice(["baseline", "eagle"])
        hint = rng.choice([None, None, "code", "math", "chat", "poem"])
        accept = rng.uniform(2.0, 4.0) if pool == "eagle" and rng.random() < 0.5 else None
        cal.observe(pool, rng.randrange(1, 100), hint, slow * rng.uniform(0.7, 1.3), accept)  # type: ignore[arg-type]


def _calibration_predictions(cal: SpeedCalibration) -> list[float]:
    out = [cal.log_speed(p, b) for p in ("baseline", "eagle") for b in range(0, 120, 7)]  # type: ignore[arg-type]
    return out + [cal.log_hint(h) for h in (None, "code", "math", "chat", "poem", "never")]


def test_calibration_round_trips_exactly_and_goes_on_learning_alike() -> None:
    rng = random.Random(1)
    saved = _calibration()
    _teach_calibration(saved, rng, 300)
    _teach_calibration(saved, rng, 40, slow=0.3)  # a profile 3x off: the pools rebase
    assert sum(saved.mismatches.values()) >= 1 and saved.accept_reported
    loaded = _calibration()
    loaded.load_state(_through_json(saved.state()))
    assert _calibration_predictions(loaded) == _calibration_predictions(saved)
    assert loaded.state() == saved.state()
    # the same outcomes from here on: the same estimates, to the bit
    _teach_calibration(saved, random.Random(2), 200)
    _teach_calibration(loaded, random.Random(2), 200)
    assert _calibration_predictions(loaded) == _calibration_predictions(saved)


def _features(system: str, user: str, temperature: float = 0.0) -> Any:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "temperature": temperature,
    }
    return extract_features(body, "chat")


FAMILIES = {
    "You write Python code.": 0.4,
    "You are a poet.": -0.5,
    "You answer questions about history.": 0.0,
}


def _teach_content(model: AcceptanceModel, rng: random.Random, n: int) -> None:
    for i in range(n):
        system, y = rng.choice(list(FAMILIES.items()))
        f = _features(system, f"question {i % 17} about topic {rng.randrange(9)}", rng.choice([0.0, 0.7]))
        model.learn(f, rng.choice([None, "code"]), y + rng.gauss(0, 0.05), 0.0)


def _content_predictions(model: AcceptanceModel) -> list[float]:
    return [
        model.predict(_features(system, f"question {q} about topic 3"), hint, 0.1)
        for system in [*FAMILIES, "A system prompt never seen."]
        for q in (1, 5, 40)
        for hint in (None, "code")
    ]


def test_content_model_round_trips_exactly_and_goes_on_learning_alike() -> None:
    saved = AcceptanceModel()
    _teach_content(saved, random.Random(3), 400)
    assert saved.families == 3
    state = _through_json(saved.state())
    loaded = AcceptanceModel()
    loaded.load_state(state)
    assert loaded.families == 3
    assert _content_predictions(loaded) == _content_predictions(saved)
    # what was learned shows: a code prompt is predicted well above a poem
    assert loaded.predict(_features("You write Python code.", "question 1 about topic 3"), None, 0.0) > 0.2
    _teach_content(saved, random.Random(4), 100)
    _teach_content(loaded, random.Random(4), 100)
    assert _content_predictions(loaded) == _content_predictions(saved)


def test_content_model_saved_before_the_kinds_offsets_loads_with_the_kinds_untaught() -> None:
    """A state file written by the previous layout (version 3: no kinds' offsets) is read, not
    thrown away: the tokens, families and means come back, and the kinds start over."""
    saved = AcceptanceModel()
    _teach_content(saved, random.Random(3), 400)
    state = _through_json(saved.state())
    assert unpack(state["kind_keys"], "<i8", "test")  # what the kinds learned is saved
    old = {k: v for k, v in state.items() if not k.startswith("kind_")} | {"version": 3}
    loaded = AcceptanceModel()
    loaded.load_state(old)
    assert loaded.families == saved.families
    assert unpack(loaded.state()["kind_keys"], "<i8", "test") == []
    assert unpack(loaded.state()["token_weights"], "<f8", "t") == unpack(state["token_weights"], "<f8", "t")
    assert loaded.predict(_features("You write Python code.", "question 1 about topic 3"), None, 0.0) > 0.2


def test_prefix_index_round_trips_and_a_smaller_index_keeps_the_most_recent() -> None:
    saved = PrefixIndex(100)
    for start in range(0, 300, 10):
        saved.insert(list(range(start, start + 10)))
    loaded = PrefixIndex(100)
    loaded.load_state(_through_json(saved.state()))
    assert loaded.state() == saved.state() and len(loaded) == 100
    small = PrefixIndex(10)
    small.load_state(saved.state())
    blocks = unpack(saved.state()["blocks"], "<u8", "test")
    assert unpack(small.state()["blocks"], "<u8", "test") == blocks[-10:] == list(range(299, 289, -1))
    assert small.match(list(range(290, 300))) == 10 and small.match(list(range(280, 290))) == 0
    off = PrefixIndex(0)
    off.load_state(saved.state())
    assert len(off) == 0


def _cost_model(**params: Any) -> Any:
    context = PolicyContext(resolve_profile("kimi-k25-int4-8gpu"), seed=0)
    return default_registry(entry_points=False).create("cost_model", params, context)


def test_cost_model_state_holds_its_calibration_and_content_model() -> None:
    policy = _cost_model()
    assert id(learner(policy)) == id(policy)  # (`is` would narrow `policy` to what learner returns)
    rng = random.Random(5)
    _teach_calibration(policy.calibration, rng, 200)
    _teach_content(policy.content.model, rng, 200)
    fresh = _cost_model()
    fresh.load_state(_through_json(policy.state()))
    assert fresh.state() == policy.state()
    assert _content_predictions(fresh.content.model) == _content_predictions(policy.content.model)
    assert _calibration_predictions(fresh.calibration) == _calibration_predictions(policy.calibration)
    # saved content-aware, loaded content-blind (other parameters): refused, nothing changed
    blind = _cost_model(content_aware=False)
    before = blind.state()
    with pytest.raises(StateError, match="content"):
        blind.load_state(policy.state())
    assert blind.state() == before


def test_cost_model_takes_neither_part_when_one_is_refused() -> None:
    policy, target = _cost_model(), _cost_model()
    _teach_calibration(policy.calibration, random.Random(6), 100)
    _teach_content(policy.content.model, random.Random(6), 100)
    before = target.state()
    state = _through_json(policy.state())
    state["content"]["dim"] = 8  # the calibration loads first, then the content model refuses
    with pytest.raises(StateError, match="dimensions"):
        target.load_state(state)
    assert target.state() == before


def _broken(state: dict[str, Any], changes: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    out = copy.deepcopy(state)
    for path, value in changes.items():
        node = out
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return out


def _taught(kind: str, seed: int, n: int) -> Any:
    if kind == "calibration":
        cal = _calibration()
        _teach_calibration(cal, random.Random(seed), n)
        return cal
    model = AcceptanceModel()
    _teach_content(model, random.Random(seed), n)
    return model


CAL_BROKEN = [
    (["version"], 2, "version"),
    (["pool", "eagle"], [3, math.nan], "finite"),
    (["pool", "eagle"], [-1, 0.1], "non-negative"),
    (["buckets", "baseline"], [[0, 0.0]], "load buckets"),
    (["own_part", "eagle"], [0.0], "values"),
    (["pool"], {"baseline": [0, 0.0]}, "pools"),
    (["accept_reported"], "yes", "true or false"),
    (["max_log"], 9.0, "bound"),
    (["recent", "eagle"], [0.0] * 40, "window"),
    (
        ["hints", "slots"],
        [["a", 1, 0, 0.0], ["b", 1, 0, 0.0], ["c", 1, 0, 0.0], ["d", 1, 0, 0.0]],
        "slots",
    ),
    (["hints", "slots"], [[7, 1, 0, 0.0]], "hint"),
]


def _tokens(slots: list[int], weights: list[float], counts: list[int]) -> dict[tuple[str, ...], Any]:
    """Changes that replace the taught tokens whole (their three arrays are of one length)."""
    return {
        ("token_slots",): pack(slots, "<i8"),
        ("token_weights",): pack(weights, "<f8"),
        ("token_counts",): pack(counts, "<i8"),
    }


CONTENT_BROKEN = [
    ({("dim",): 1024}, "dimensions"),
    (_tokens([1 << 20], [0.1], [1]), "out of range"),
    (_tokens([3, 3], [0.1, 0.2], [1, 1]), "repeated"),
    (_tokens([3], [0.1], [0]), "untaught"),
    (_tokens([3], [math.inf], [1]), "finite"),
    (_tokens([3], [0.1], [-1]), "non-negative"),
    ({("token_slots",): pack([3, 4], "<i8")}, "values where"),
    ({("token_weights",): "not base64!"}, "base64"),
    ({("params",): pack([0.0] * 3, "<f8")}, "values where"),
    ({("family_keys",): pack([1, 1, 2], "<u8"), ("family_counts",): pack([1, 1, 1], "<i8"),
      ("family_taught_at",): pack([0] * 3, "<i8"), ("family_clients",): pack([0] * 3, "<i8"),
      ("client_keys",): pack([], "<u8"), ("client_outcomes",): pack([], "<f8"),
      ("client_recent",): pack([], "<f8"), ("client_offsets",): pack([], "<f8")}, "repeated"),
    ({("family_keys",): [1, 2, 3]}, "base64 string"),
    ({("kind_keys",): pack([0, 0], "<i8"), ("kind_outcomes",): pack([1.0, 1.0], "<f8"),
      ("kind_offsets",): pack([0.0, 0.0], "<f8")}, "kind is repeated"),
    ({("kind_keys",): pack([1 << 40], "<i8"), ("kind_outcomes",): pack([1.0], "<f8"),
      ("kind_offsets",): pack([0.0], "<f8")}, "out of range"),
    ({("kind_keys",): pack([2], "<i8"), ("kind_outcomes",): pack([0.0], "<f8"),
      ("kind_offsets",): pack([0.0], "<f8")}, "never taught"),
    ({("kind_offsets",): pack([0.0] * 9, "<f8")}, "values where"),
    ({("client_offsets",): "AAAA"}, "8-byte"),
    ({("cov",): [1]}, "samples"),
    ({("sent",): [1, math.nan]}, "finite"),
    ({("shift",): 5.0}, "beyond"),
    ({("taught",): -1}, "non-negative"),
    ({("version",): None}, "version"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "changes", "match"),
    [("calibration", {tuple(path): value}, match) for path, value, match in CAL_BROKEN]
    + [("content", changes, match) for changes, match in CONTENT_BROKEN],
)
def test_bad_state_is_refused_and_the_learner_stays_as_it_was(
    kind: str, changes: dict[tuple[str, ...], Any], match: str
) -> None:
    source, target = _taught(kind, 7, 100), _taught(kind, 8, 40)
    before = target.state()
    with pytest.raises(StateError, match=match):
        target.load_state(_broken(source.state(), changes))
    assert target.state() == before


@pytest.mark.parametrize("blocks", [[1, 2], "1,2", "AAAA", None, pack([1.5], "<f8")[:-1]])
def test_prefix_index_refuses_what_is_not_block_hashes(blocks: Any) -> None:
    index = PrefixIndex(10)
    index.insert([1, 2, 3])
    with pytest.raises(StateError):
        index.load_state({"version": 1, "blocks": blocks})
    assert unpack(index.state()["blocks"], "<u8", "test") == [3, 2, 1]
    with pytest.raises(StateError):
        index.load_state(["not", "an", "object"])
