"""The simulator shows truth vs belief and the best possible: `--server-profile`,
`--server-speed`, `--oracle` (checked by hand on a tiny profile), and `tune`'s steady-state
defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.cli import main

# Step time t(b) = a + c*b exactly, TTFT 0; requests of 11 tokens (10 decode steps).
#   baseline t = 0.01 + 0.01 b:   X_b(k) = 11 k / (10 (0.01 + 0.01 k))       = 110 k / (1 + k)
#   eagle    t = 0.005 + 0.02 b, at most 2 running: X_e(1) = 11 / 0.25 = 44, X_e(k>=2) = 22 / 0.45
TINY: dict[str, Any] = {
    "format": "specroute.profile/v1",
    "name": "tiny",
    "modes": {
        "baseline": {
            "points": [{"concurrency": b, "decode_tok_s": 1 / (0.01 + 0.01 * b), "ttft_s": 0} for b in (1, 2)]
        },
        "eagle": {
            "max_running_requests": 2,
            "points": [
                {"concurrency": b, "decode_tok_s": 1 / (0.005 + 0.02 * b), "ttft_s": 0} for b in (1, 2)
            ],
        },
    },
}


def simulate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict[str, Any], str]:
    code = main(["simulate", "--json", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc, err


def test_oracle_values_by_hand_on_a_tiny_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "tiny.json"
    profile.write_text(json.dumps(TINY))
    doc, err = simulate(
        capsys, "--profile", str(profile), "--oracle", "--concurrency", "1", "2", "3",
        "--output-tokens", "const:11", "--policy", "fixed:pool=baseline", "--policy", "cost_model",
    )  # fmt: skip
    fixed, cost = doc["runs"]
    # C=1: baseline 55 beats eagle 44; C=2: one each, 44 + 55 = 99 beats 110*2/3 = 73.3 and 48.9;
    # C=3: one on eagle, two on baseline, 44 + 73.33 = 117.33 (eagle never runs more than 2)
    expected = [
        (55.0, {"baseline": 1, "eagle": 0}),
        (99.0, {"baseline": 1, "eagle": 1}),
        (44 + 220 / 3, {"baseline": 2, "eagle": 1}),
    ]
    for run in (fixed, cost):
        got = [(lv["oracle_throughput_tok_s"], lv["oracle_split"]) for lv in run["levels"]]
        assert [g[1] for g in got] == [e[1] for e in expected]
        assert [g[0] for g in got] == pytest.approx([e[0] for e in expected])
        for lv in run["levels"]:
            assert lv["oracle_ratio"] == pytest.approx(lv["throughput_tok_s"] / lv["oracle_throughput_tok_s"])
    # a static split that is the best one measures the oracle's figure: the simulator agrees with it
    assert fixed["levels"][0]["oracle_ratio"] == pytest.approx(1.0, abs=0.005)
    assert [lv["oracle_ratio"] for lv in fixed["levels"][1:]] == pytest.approx(
        [73.33 / 99, 82.5 / 117.33], abs=0.01
    )
    assert all(lv["oracle_ratio"] == pytest.approx(1.0, abs=0.01) for lv in cost["levels"])
    assert err == ""  # steady-state sizing by default: nothing to warn about


def test_oracle_in_the_table_and_its_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--profile", "kimi-k25-int4-8gpu", "--oracle", "--concurrency", "1", "5"]) == 0
    out, _ = capsys.readouterr()
    assert "oracle tok/s" in out and "vs oracle" in out and "max(30, 10 x clients)" in out
    assert main(["simulate", "--profile", "kimi-k25-int4-8gpu", "--oracle", "--workload", "poisson"]) == 2
    assert "--oracle needs a closed-loop sweep" in capsys.readouterr().err
    code = main(
        [
            "simulate",
            "--profile",
            "kimi-k25-int4-8gpu",
            "--oracle",
            "--concurrency",
            "50",
            "--requests-per-level",
            "40",
        ]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert "warning: concurrency 50:" in err and "measure a transient" in err and "at least 500 and 50" in err


def test_servers_run_from_the_server_profile_while_policies_keep_theirs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [
        "--profile", "kimi-k25-int4-8gpu", "--concurrency", "1", "--policy", "fixed:pool=eagle",
        "--policy", "cost_model:calibrate=false", "--policy", "cost_model",
    ]  # fmt: skip
    doc, _ = simulate(capsys, *base)
    truth, _ = simulate(capsys, *base, "--server-speed", "eagle=0.5")
    eagle_rate = doc["runs"][0]["levels"][0]["mean_decode_tok_s"]
    assert eagle_rate == pytest.approx(96.1)
    assert truth["runs"][0]["levels"][0]["mean_decode_tok_s"] == pytest.approx(96.1 / 2)
    assert truth["server_profile"] == "kimi-k2.5-int4 8 GPUs, SGLang (headline figures); eagle x0.5"
    assert "server_profile" not in doc
    # a one-mode server profile replaces that mode only
    slow = json.loads(Path("policies/profiles/kimi-k25-int4-8gpu.json").read_text())
    del slow["modes"]["baseline"]
    for p in slow["modes"]["eagle"]["points"]:
        p["decode_tok_s"] /= 4
    path = tmp_path / "slow-eagle.json"
    path.write_text(json.dumps({**slow, "name": "slow eagle"}))
    swapped, _ = simulate(capsys, *base, "--server-profile", str(path))
    assert swapped["runs"][0]["levels"][0]["mean_decode_tok_s"] == pytest.approx(96.1 / 4)
    assert swapped["server_profile"] == "slow eagle"
    # believing the profile, cost_model keeps sending a lone request to eagle; calibrated, it
    # learns from its first outcomes that eagle is now the slow one
    assert swapped["runs"][1]["levels"][0]["pool_share"]["eagle"] == 1.0
    assert swapped["runs"][2]["levels"][0]["pool_share"]["eagle"] == 0.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--server-speed", "turbo=2"], "expected MODE=FACTOR"),
        (["--server-speed", "eagle=0"], "FACTOR > 0"),
        (["--server-speed", "eagle=0.8,eagle=0.9"], "eagle given twice"),
        (
            ["--server-profile", "kimi-k25-int4-8gpu", "--server-profile", "llama31-8b-h100-eagle3"],
            "both give the",
        ),
        (["--server-profile", "no-such-profile"], "no built-in profile"),
    ],
)
def test_server_profile_errors_are_clear(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["simulate", "--profile", "kimi-k25-int4-8gpu", "--concurrency", "1", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_tune_measures_steady_states_and_ranks_sweeps_by_throughput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "tune", "--profile", "kimi-k25-int4-8gpu", "--policy", "threshold", "--grid", "threshold=1,8,48",
        "--concurrency", "5", "30", "--jobs", "1",
    ]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "a.yaml")]) == 0
    out, err = capsys.readouterr()
    assert "objective: throughput_tok_s (total output tok/s; higher is better)" in out
    assert "max(30, 10 x clients) requests/level + max(5, 1 x clients) warm-up" in out
    assert "warning" not in err
    rows = [line.split() for line in out.splitlines() if line.lstrip()[:1].isdigit()]
    scores = [float(r[2]) for r in rows]
    assert scores == sorted(scores, reverse=True)  # highest throughput first
    # a user's own sizes that measure a transient are warned about, then used
    assert (
        main(
            [*args, "--requests-per-level", "30", "--warmup-requests", "5", "--out", str(tmp_path / "b.yaml")]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "warning: concurrency 5, 30:" in err and "30 requests/level + 5 warm-up" in out
