"""Statistics, `specroute compare`, `specroute profile merge` and the SGLang import: no servers
needed, the inputs are result files and profiles as users have them on disk."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from controller.bench.result import BenchResult, LevelResult, RequestResult, summarize
from controller.cli import main
from policies.profile import load_profile
from policies.stats import estimate, percentile, t_quantile, verdict

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sglang_bench_sample.jsonl"


@pytest.mark.parametrize(
    ("df", "expected"),
    [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (29, 2.0452), (120, 1.9799), (5000, 1.9600)],
)
def test_t_quantile_matches_tables(df: int, expected: float) -> None:
    assert t_quantile(0.95, df) == pytest.approx(expected, abs=2e-4)


def test_t_quantile_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="confidence"):
        t_quantile(1.5, 3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile(0.95, 0)


def test_estimate_interval_shrinks_with_more_samples() -> None:
    rng = random.Random(1)
    data = [rng.gauss(90.0, 5.0) for _ in range(400)]
    widths = []
    for n in (5, 30, 400):
        e = estimate(data[:n])
        assert e is not None and e.half_width is not None
        widths.append(e.half_width)
    assert widths[0] > widths[1] > widths[2]
    e = estimate(data)
    assert e is not None and e.low < 90.0 < e.high


def test_estimate_small_samples() -> None:
    assert estimate([]) is None
    one = estimate([3.0])
    assert one is not None and one.half_width is None and one.mean == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def _level(conc: int, rates: list[float], ttft: float, errors: int = 0, tokens: int = 101) -> LevelResult:
    """A level of measured requests with the given decode rates (one request after another)."""
    reqs = []
    t = 0.0
    for rate in rates:
        first = t + ttft
        last = first + (tokens - 1) / rate
        reqs.append(
            RequestResult(
                phase="measured",
                start_s=t,
                ttft_s=ttft,
                first_token_s=first,
                last_token_s=last,
                end_s=last,
                completion_tokens=tokens,
                status=200,
            )
        )
        t = last
    for _ in range(errors):
        reqs.append(RequestResult(phase="measured", start_s=t, end_s=t + 0.01, status=500, error="HTTP 500"))
    return LevelResult(concurrency=conc, requests=reqs, summary=summarize(conc, reqs))


def _write(path: Path, label: str, levels: list[LevelResult], prompt_set: str = "coding") -> str:
    md = {"label": label, "url": "http://x", "prompt_set": prompt_set}
    BenchResult(metadata=md, levels=levels).write(path)
    return str(path)


def test_compare_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [90.0, 92.0, 91.0, 93.0, 89.0, 90.5, 91.5, 92.5, 90.0, 91.0, 92.0, 90.0]
    a = _write(tmp_path / "a.json", "baseline", [_level(1, base, 0.20), _level(8, base, 0.30)])
    b = _write(
        tmp_path / "b.json",
        "eagle",
        [
            _level(1, [r + 0.5 for r in base], 0.20),  # overlapping intervals
            _level(8, [r * 1.3 for r in base[:6]], 0.25, errors=1),  # clearly faster, lower TTFT
        ],
        prompt_set="general",
    )
    assert main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    row = next(ln for ln in lines if ln.startswith("1 ") and "decode tok/s" in ln)
    assert "not distinguishable" in row and "(n=12)" in row
    i = next(k for k, ln in enumerate(lines) if ln.startswith("8 "))
    decode, ttft, e2e, total, errors, verdict_row = lines[i : i + 6]
    m = re.search(r"([+-]\d+\.\d)% faster", decode)
    expected = (sum(base[:6]) / 6 * 1.3) / (sum(base) / len(base)) - 1
    assert "decode tok/s" in decode and m and float(m.group(1)) == pytest.approx(expected * 100, abs=0.06)
    assert "TTFT" in ttft and "-16.7% faster" in ttft  # lower TTFT is faster
    assert "e2e s" in e2e and "faster" in e2e
    assert "total tok/s" in total
    assert "errors" in errors and "1/7" in errors
    assert "verdict" in verdict_row and "e2e -" in verdict_row and "faster" in verdict_row
    assert "queued" not in out  # nothing queued: TTFT within 10x of concurrency 1's
    assert "warning: [2] eagle, concurrency 8: only 6 successful requests" in out
    assert "runs differ in prompt_set ([1] coding, [2] general)" in out
    assert "concurrency 1" not in "".join(ln for ln in lines if ln.startswith("warning"))


def test_compare_flags_runs_measured_with_different_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Answers of 64 tokens take longer than answers of 32: such runs are named before the table,
    and every verdict of the run says it is not like for like; runs that agree get no flag."""
    rates = [90.0, 92.0, 91.0, 93.0, 89.0, 90.5, 91.5, 92.5, 90.0, 91.0, 92.0, 90.0]
    paths = []
    for name, tokens in (("short", 33), ("long", 65), ("long-again", 65)):
        md = {"label": name, "url": "http://x", "prompt_set": "coding", "max_tokens": tokens - 1}
        path = tmp_path / f"{name}.json"
        BenchResult(metadata=md, levels=[_level(c, rates, 0.2, tokens=tokens) for c in (1, 4)]).write(path)
        paths.append(str(path))
    assert main(["compare", paths[0], paths[1]]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    warning = "warning: runs differ in max_tokens ([1] 32, [2] 64): not a like-for-like comparison"
    assert lines.index(warning) < next(i for i, ln in enumerate(lines) if ln.startswith("conc"))
    verdicts = [ln for ln in lines if "verdict" in ln.split()[:2]]
    assert len(verdicts) == 2 and all("(not like for like: max_tokens differs)" in v for v in verdicts)
    assert main(["compare", paths[1], paths[2]]) == 0
    out = capsys.readouterr().out
    assert "like for like" not in out and "like-for-like" not in out


def test_compare_verdict_weighs_e2e_and_flags_queueing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: at a high level eagle decodes faster once it runs, but its requests
    waited in the server's queue (TTFT 40x level 1's): the verdict is e2e's (slower), the
    decode verdict is shown as what it would have said, and the level is flagged as queued."""
    base = [90.0, 92.0, 91.0, 93.0, 89.0, 90.5, 91.5, 92.5, 90.0, 91.0, 92.0, 90.0]
    a = _write(
        tmp_path / "a.json", "baseline", [_level(1, base, 0.20), _level(250, [r / 2 for r in base], 0.5)]
    )
    queued_eagle = BenchResult(
        metadata={
            "label": "eagle",
            "url": "http://y",
            "prompt_set": "coding",
            "backend_queue_max": {"250": 202},
        },
        levels=[_level(1, base, 0.22), _level(250, [r / 1.5 for r in base], 8.0)],
    )
    queued_eagle.write(tmp_path / "b.json")
    # a server without queue metrics: its TTFT (36x level 1's) is the evidence
    c = _write(
        tmp_path / "c.json", "other", [_level(1, base, 0.22), _level(250, [r / 1.5 for r in base], 8.0)]
    )
    # a server whose metrics said 0 queued: TTFT growth alone (prefill batching) is not queueing
    calm = BenchResult(
        metadata={
            "label": "calm",
            "url": "http://z",
            "prompt_set": "coding",
            "backend_queue_max": {"250": 0},
        },
        levels=[_level(1, base, 0.22), _level(250, [r / 1.5 for r in base], 8.0)],
    )
    calm.write(tmp_path / "d.json")
    assert main(["compare", a, str(tmp_path / "b.json"), c, str(tmp_path / "d.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("250 "))
    decode, verdict_row = lines[i], lines[i + 5]
    assert "decode tok/s" in decode and "faster" in decode
    assert verdict_row.split()[0] == "verdict"
    assert "slower (decode alone would say faster)" in verdict_row
    assert "queued: decode rate is not the user's experience" in verdict_row
    assert "(server queue up to 202)" in verdict_row and "(p50 TTFT 8 s, 36x concurrency 1's)" in verdict_row
    assert verdict_row.count("queued:") == 2  # eagle and other; not calm, not the baseline
    level_1 = next(ln for ln in lines if ln.strip().startswith("verdict"))
    assert "queued" not in level_1 and "not distinguishable" in level_1


def test_verdict_slower_and_missing() -> None:
    fast = estimate([100.0, 101.0, 99.0])
    slow = estimate([50.0, 51.0, 49.0])
    assert verdict(fast, slow, higher_is_better=True) == "slower"
    assert verdict(slow, fast, higher_is_better=False) == "slower"
    assert verdict(fast, estimate([60.0]), higher_is_better=True) == "not distinguishable"


def test_compare_rejects_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    assert main(["compare", str(bad)]) == 2
    assert "not a specroute bench result" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def _profile(tmp_path: Path, name: str, mode: str, rates: list[float]) -> str:
    result = BenchResult(metadata={"label": name}, levels=[_level(c, rates, 0.2) for c in (1, 4)])
    path = tmp_path / f"{name}.json"
    path.write_text(result.to_profile(mode, name).to_json())  # type: ignore[arg-type]
    return str(path)


def test_profile_merge(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _profile(tmp_path, "plain", "baseline", [90.0, 92.0])
    b = _profile(tmp_path, "spec", "eagle", [95.0, 97.0])
    out = tmp_path / "both.json"
    assert main(["profile", "merge", a, b, "-o", str(out)]) == 0
    merged = load_profile(out)
    assert set(merged.modes) == {"baseline", "eagle"}
    assert merged.mode("baseline") == load_profile(a).mode("baseline")
    assert merged.mode("eagle").points[0].decode_tok_s == pytest.approx(96.0, rel=1e-3)
    assert merged.speed("eagle").decode_tok_s(1) > merged.speed("baseline").decode_tok_s(1)
    capsys.readouterr()
    c = _profile(tmp_path, "spec2", "eagle", [80.0, 81.0])
    assert main(["profile", "merge", b, c, "-o", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "have a 'eagle' mode" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()
    assert main(["profile", "merge", a, b, "-o", str(tmp_path / "no" / "m.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_import_sglang_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "eagle.json"
    code = main(["bench", "--import-sglang", str(SAMPLE), "--mode", "eagle", "--profile-out", str(out)])
    assert code == 0
    err = capsys.readouterr().err
    assert "no max_concurrency" in err  # the request-rate line is skipped, with a warning
    mode = load_profile(out).mode("eagle")
    pts = {p.concurrency: p for p in mode.points}
    assert sorted(pts) == [1, 8, 32]
    # concurrency 1: two lines, weighted by completed (30 and 10)
    assert pts[1].decode_tok_s == pytest.approx((1000 / 10.4 * 30 + 1000 / 12.5 * 10) / 40, rel=1e-4)
    assert pts[1].ttft_s == pytest.approx((0.220 * 30 + 0.260 * 10) / 40, rel=1e-4)
    assert pts[1].samples == 40
    # concurrency 8 has no mean_tpot_ms: median ITL per chunk x accept length
    assert pts[8].decode_tok_s == pytest.approx(1000 / 40.0 * 2.2, rel=1e-4)
    assert pts[32].decode_tok_s == pytest.approx(20.0) and pts[32].ttft_s == pytest.approx(0.45)
    assert mode.max_running_requests == 48
    assert mode.accept_length == pytest.approx((2.4 + 2.2 + 2.0 + 2.4) / 4)


def test_import_sglang_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    only_rate = tmp_path / "rate.jsonl"
    only_rate.write_text(json.dumps({"max_concurrency": None, "mean_tpot_ms": 10.0}) + "\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    for path, needle in [(only_rate, "no usable benchmark result lines"), (broken, "broken.jsonl:1")]:
        assert main(["bench", "--import-sglang", str(path), "--mode", "baseline"]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err
    assert main(["bench", "--import-sglang", str(SAMPLE)]) == 2
    assert "--mode" in capsys.readouterr().err
    missing = tmp_path / "no" / "p.json"
    assert (
        main(["bench", "--import-sglang", str(SAMPLE), "--mode", "eagle", "--profile-out", str(missing)]) == 2
    )
    assert f"cannot write {missing}" in capsys.readouterr().err
    # without --profile-out the profile goes to stdout
    assert main(["bench", "--import-sglang", str(SAMPLE), "--mode", "baseline"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "specroute.profile/v1" and "accept_length" not in data["modes"]["baseline"]


def test_import_sglang_says_what_it_assumed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Results without server_info: an eagle profile gets SGLang's speculative cap (48) and says
    so; a baseline profile gets none and says what that means."""
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"max_concurrency": 4, "mean_tpot_ms": 12.5, "mean_ttft_ms": 300}) + "\n")
    out = tmp_path / "p.json"
    assert main(["bench", "--import-sglang", str(bare), "--mode", "eagle", "--profile-out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "assumed: max_running_requests 48" in err and "--max-running-requests" in err
    assert load_profile(out).mode("eagle").max_running_requests == 48
    assert main(["bench", "--import-sglang", str(bare), "--mode", "baseline", "--profile-out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "assumed: no max_running_requests" in err and "no server queue" in err
    assert load_profile(out).mode("baseline").max_running_requests is None
    # with server_info the cap is read, and the note says where from
    assert main(["bench", "--import-sglang", str(SAMPLE), "--mode", "eagle", "--profile-out", str(out)]) == 0
    assert "assumed: max_running_requests 48, from the results' server_info" in capsys.readouterr().err
