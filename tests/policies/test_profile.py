"""Speed profiles: loading, validation errors, interpolation rules, the shipped profiles."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import Pool
from policies.profile import ProfileError, concave_points, load_profile, parse_profile, resolve_profile


def _profile(points: list[tuple[float, float, float]], cap: int | None = None) -> dict[str, object]:
    mode: dict[str, object] = {
        "points": [{"concurrency": c, "decode_tok_s": r, "ttft_s": t} for c, r, t in points]
    }
    if cap is not None:
        mode["max_running_requests"] = cap
    return {"format": "specroute.profile/v1", "name": "t", "modes": {"baseline": mode}}


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


# -- shipped profiles ---------------------------------------------------------------------


def test_kimi_profile_matches_its_headline_figures() -> None:
    p = resolve_profile("kimi-k25-int4-8gpu")
    assert "92.7" in p.source and "773" in p.source and "354" in p.source
    b, e = p.speed("baseline"), p.speed("eagle")
    assert b.max_running_requests == 256 and e.max_running_requests == 48
    assert b.decode_tok_s(1) == pytest.approx(92.7, rel=1e-6)
    assert e.decode_tok_s(1) == pytest.approx(96.1, rel=1e-6)
    assert b.throughput_tok_s(250) == pytest.approx(773, rel=1e-3)
    assert e.throughput_tok_s(48) == pytest.approx(354, rel=1e-3)
    assert [pt.concurrency for pt in p.mode("baseline").points] == [1, 2, 5, 10, 30, 70, 100, 250]
    # every point lies on the fitted line t(b) = a + c*b
    fits: tuple[tuple[Pool, float, float], ...] = (
        ("baseline", 0.009532, 0.0012555),
        ("eagle", 0.007742, 0.0026636),
    )
    for mode, a, c in fits:
        for pt in p.mode(mode).points:
            assert 1 / pt.decode_tok_s == pytest.approx(a + c * pt.concurrency, rel=1e-3)


def test_llama_profile_matches_the_eagle3_paper_figures() -> None:
    p = resolve_profile("llama31-8b-h100-eagle3")
    assert "2503.01840" in p.source and "ASSUMED" in p.source
    b, e = p.speed("baseline"), p.speed("eagle")
    assert b.decode_tok_s(1) == pytest.approx(158, rel=1e-3)
    assert e.decode_tok_s(1) == pytest.approx(373, rel=1e-3)
    assert b.step_time(64) == pytest.approx(2 * b.step_time(1), rel=1e-3)
    for batch, gain in ((2, 1.81), (16, 1.48), (64, 1.38)):
        assert e.throughput_tok_s(batch) / b.throughput_tok_s(batch) == pytest.approx(gain, rel=2e-3)
    # EAGLE-3 wins at every batch size
    assert all(e.decode_tok_s(n) > b.decode_tok_s(n) for n in range(1, 1000))


def test_resolve_by_path_and_unknown_builtin_lists_known() -> None:
    path = Path(__file__).resolve().parents[2] / "policies" / "profiles" / "kimi-k25-int4-8gpu.json"
    assert resolve_profile(path).name == resolve_profile("kimi-k25-int4-8gpu").name
    with pytest.raises(ProfileError, match=r"no built-in profile 'nope'.*kimi-k25-int4-8gpu.*llama31"):
        resolve_profile("nope")


def test_a_missing_profile_file_named_alone_is_reported_as_a_missing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--profile my-profile.json` in a folder without it: the file is what is missing, not a
    built-in profile of that name; a built-in's name with `.json` still finds the built-in."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProfileError) as info:
        resolve_profile("my-profile.json")
    text = str(info.value)
    assert text.startswith("my-profile.json: no such profile file") and str(tmp_path) in text
    assert "no built-in profile" not in text and "kimi-k25-int4-8gpu" in text
    assert resolve_profile("kimi-k25-int4-8gpu.json").name == resolve_profile("kimi-k25-int4-8gpu").name
    (tmp_path / "my-profile.json").write_text((Path(__file__).resolve().parents[2] / "policies" / "profiles" /
                                               "kimi-k25-int4-8gpu.json").read_text())  # fmt: skip
    assert resolve_profile("my-profile.json").name == resolve_profile("kimi-k25-int4-8gpu").name


# -- errors name the file and the field ---------------------------------------------------


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"missing\.json: cannot read profile"):
        load_profile(tmp_path / "missing.json")


def test_invalid_json_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ProfileError, match=r"bad\.json: not valid JSON"):
        load_profile(path)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (
            lambda d: d["modes"]["baseline"]["points"][0].update(decode_tok_s=0),
            "modes.baseline.points.0.decode_tok_s",
        ),
        (lambda d: d["modes"]["baseline"]["points"][0].update(decode_tok_s=float("inf")), "decode_tok_s"),
        (lambda d: d["modes"]["baseline"]["points"][0].update(ttft_s=-1), "modes.baseline.points.0.ttft_s"),
        (lambda d: d["modes"]["baseline"].update(max_running_requests=0), "max_running_requests"),
        (lambda d: d["modes"]["baseline"].update(points=[]), "modes.baseline.points"),
        (lambda d: d.update(format="v0"), "format"),
        (lambda d: d.pop("modes"), "modes"),
        (lambda d: d["modes"].update(turbo=d["modes"]["baseline"]), "modes.turbo"),
        (lambda d: d["modes"]["baseline"]["points"].append(d["modes"]["baseline"]["points"][0]), "duplicate"),
    ],
)
def test_broken_profile_error_names_file_and_field(tmp_path: Path, mutate: object, field: str) -> None:
    data = _profile([(1, 100, 0.1), (4, 50, 0.2)])
    mutate(data)  # type: ignore[operator]
    path = _write(tmp_path, data)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(path) in str(info.value) and field in str(info.value)


def test_missing_mode_is_a_clear_error() -> None:
    p = parse_profile(_profile([(1, 100, 0.1)]))
    with pytest.raises(ProfileError, match=r"no 'eagle' mode \(has: baseline\)"):
        p.speed("eagle")


# -- interpolation exactly as policies/profile.py's opening says ---------------------------


def test_step_time_linear_between_constant_below_slope_beyond() -> None:
    # step times 0.01 s at 2, 0.02 s at 4, 0.05 s at 10
    s = parse_profile(_profile([(10, 20, 0.5), (2, 100, 0.1), (4, 50, 0.2)])).speed("baseline")
    assert s.step_time(3) == pytest.approx(0.015)
    assert s.decode_tok_s(3) == pytest.approx(1 / 0.015)
    assert s.step_time(7) == pytest.approx(0.035)
    assert s.step_time(1) == pytest.approx(0.01) and s.step_time(0) == pytest.approx(0.01)
    assert s.step_time(16) == pytest.approx(0.05 + 6 * 0.005)  # last slope 0.03/6 per request
    assert s.step_time(10_000) == pytest.approx(0.05 + 9990 * 0.005)  # beyond the lookup table
    assert s.throughput_tok_s(4) == pytest.approx(4 / 0.02)
    # TTFT: same rule
    assert s.ttft_s(3) == pytest.approx(0.15) and s.ttft_s(1) == pytest.approx(0.1)
    assert s.ttft_s(16) == pytest.approx(0.5 + 6 * (0.3 / 6))
    arr = s.step_time_array(np.array([0, 1, 3, 7, 16]))
    assert arr.tolist() == pytest.approx([0.01, 0.01, 0.015, 0.035, 0.08])
    assert s.decode_tok_s_array([3]).tolist() == pytest.approx([1 / 0.015])


def test_ttft_beyond_last_point_never_falls_below_it() -> None:
    s = parse_profile(_profile([(1, 100, 0.5), (2, 90, 0.3)])).speed("baseline")
    assert s.ttft_s(50) == pytest.approx(0.3)


def test_single_point_profile_is_constant() -> None:
    s = parse_profile(_profile([(1, 50, 0.2)])).speed("baseline")
    assert s.decode_tok_s(1) == s.decode_tok_s(100) == pytest.approx(50)
    assert s.ttft_s(100) == pytest.approx(0.2)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.floats(1.0, 500.0), st.floats(0.0, 2.0)),
        min_size=1,
        max_size=6,
        unique_by=lambda t: t[0],
    ),
    st.integers(0, 5000),
)
def test_scalar_lookups_equal_the_numpy_path(points: list[tuple[int, float, float]], batch: int) -> None:
    s = parse_profile(_profile([(float(c), r, t) for c, r, t in points])).speed("baseline")
    assert s.step_time(batch) == pytest.approx(float(s.step_time_array(batch)), rel=1e-12)
    assert s.ttft_s(batch) == pytest.approx(float(s.ttft_array(batch)), rel=1e-12, abs=1e-15)
    assert s.step_time(batch) > 0


# -- predicted end-to-end time ------------------------------------------------------------


def test_predict_below_cap_joins_the_batch() -> None:
    s = parse_profile(_profile([(2, 100, 0.1), (4, 50, 0.2)], cap=4)).speed("baseline")
    ttft, e2e = s.predict_e2e_s(11, running=1, queued=1)  # batch of 3
    assert ttft == pytest.approx(0.15)
    assert e2e == pytest.approx(0.15 + 10 * 0.015)
    ttft, e2e = s.predict_e2e_s(11, running=1, queued=1, rate_scale=2.0)
    assert e2e == pytest.approx(0.15 + 10 * 0.015 / 2)


def test_predict_at_cap_waits_for_completions() -> None:
    s = parse_profile(_profile([(2, 100, 0.1), (4, 50, 0.2)], cap=4)).speed("baseline")
    # full server: 4 running at 0.02 s/token; mean 100 tokens -> 4 / (100 * 0.02) = 2 completions/s;
    # 2 already waiting, so this request is admitted after 3 completions = 1.5 s
    ttft, e2e = s.predict_e2e_s(11, running=4, queued=2, mean_output_tokens=100)
    assert ttft == pytest.approx(1.5 + 0.2)
    assert e2e == pytest.approx(1.5 + 0.2 + 10 * 0.02)
    # without a mean, the request's own length stands in
    ttft, _ = s.predict_e2e_s(100, running=4, queued=2)
    assert ttft == pytest.approx(1.7)


def test_predict_includes_prefill_when_profiled() -> None:
    data = _profile([(1, 100, 0.1)])
    data["modes"]["baseline"]["prefill_tok_s"] = 1000  # type: ignore[index]
    s = parse_profile(data).speed("baseline")
    ttft, e2e = s.predict_e2e_s(1, running=0, prompt_tokens=500)
    assert ttft == pytest.approx(0.6) and e2e == pytest.approx(0.6)


# -- what a policy believes: throughput made concave ------------------------------------


def test_a_concave_profile_is_believed_as_written() -> None:
    for name in ("kimi-k25-int4-8gpu", "llama31-8b-h100-eagle3"):
        profile = resolve_profile(name)
        for pool in profile.modes:
            assert concave_points(profile.mode(pool).points) is profile.mode(pool).points
            believed, written = profile.belief(pool), profile.speed(pool)
            assert believed.step_table == written.step_table and believed.ttft_table == written.ttft_table


def test_a_point_below_the_throughput_curve_is_raised_onto_it() -> None:
    # throughput 180, 214, 500, 704 tok/s at 1, 2, 4, 8: the point at 2 is below the chord from
    # 1 (180) to 4 (500), which passes 2 at 180 + 320 / 3 tok/s
    written = [(1.0, 180.0, 0.01), (2.0, 107.0, 0.02), (4.0, 125.0, 0.03), (8.0, 88.0, 0.05)]
    mode = parse_profile(_profile(written)).mode("baseline")
    believed = concave_points(mode.points)
    assert [p.decode_tok_s for p in believed] == pytest.approx([180.0, (180 + 320 / 3) / 2, 125.0, 88.0])
    assert [p.ttft_s for p in believed] == [0.01, 0.02, 0.03, 0.05]  # only the rates move
    assert [b is w for b, w in zip(believed, mode.points, strict=True)] == [True, False, True, True]
    rates = [p.decode_tok_s for p in believed]
    xs = [0.0] + [p.concurrency for p in believed]
    ys = [0.0] + [p.concurrency * p.decode_tok_s for p in believed]
    gains = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(believed))]
    assert rates == sorted(rates, reverse=True) and gains == sorted(gains, reverse=True)


def test_a_rate_that_rises_with_the_batch_is_believed_at_the_smaller_batches_too() -> None:
    # a request faster at batch 4 than alone: throughput 92, 161, 384 is below the line 96 x b
    written = [(1.0, 92.0, 0.1), (2.0, 80.5, 0.1), (4.0, 96.0, 0.1)]
    believed = concave_points(parse_profile(_profile(written)).mode("baseline").points)
    assert [p.decode_tok_s for p in believed] == pytest.approx([96.0, 96.0, 96.0])


def test_an_adaptive_servers_points_are_believed_as_written() -> None:
    # it stops drafting at 8: its throughput may jump there
    points = [{"concurrency": c, "decode_tok_s": r, "ttft_s": 0.1, "spec_steps": k}
              for c, r, k in ((1, 150.0, 3), (4, 60.0, 1), (8, 70.0, 0))]  # fmt: skip
    doc = {"format": "specroute.profile/v1", "name": "t", "modes": {"baseline": {"points": points}}}
    mode = parse_profile(doc).mode("baseline")
    assert concave_points(mode.points) is mode.points
