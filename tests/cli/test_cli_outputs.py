"""What the offline commands tell a first-time operator: no progress bars in logs, a warning
when the offered load swamps the deployment, output folders that must exist, and trace format
errors that say which format was guessed and what is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_specroute

from controller.cli import main

KIMI = ["--profile", "kimi-k25-int4-8gpu"]


async def test_plan_and_tune_write_no_progress_bar_into_a_log(tmp_path: Path) -> None:
    """stderr is a pipe here (as under systemd, CI or `2> log`): tqdm's carriage-return frames
    would be one log line per refresh."""
    code, _, err = await run_specroute(
        "plan", *KIMI, "--servers", "2", "--workload", "poisson", "--rate", "1", "--requests", "100",
        "--loads", "1", "--out", str(tmp_path / "p.yaml"), timeout_s=240,
    )  # fmt: skip
    assert code == 0, err
    assert "\r" not in err and "simulations:" not in err and "it/s" not in err
    code, _, err = await run_specroute(
        "tune", *KIMI, "--policy", "threshold", "--grid", "threshold=2,8", "--workload", "poisson",
        "--rate", "1", "--requests", "100", "--out", str(tmp_path / "t.yaml"), timeout_s=240,
    )  # fmt: skip
    assert code == 0, err
    assert "\r" not in err and "grid points" not in err
    assert (tmp_path / "t.yaml").is_file() and (tmp_path / "p.yaml").is_file()


@pytest.mark.parametrize(
    "command",
    [
        ["tune", *KIMI, "--policy", "threshold", "--grid", "threshold=2,8", "--concurrency", "1"],
        ["plan", *KIMI, "--servers", "2", "--concurrency", "1"],
    ],
    ids=["tune", "plan"],
)
def test_out_into_a_missing_folder_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """As `bench --out` and `profile merge -o` do: a typo in a folder name is an error at once,
    not a folder created silently after minutes of simulation."""
    target = tmp_path / "no-such-dir" / "config.yaml"
    assert main([*command, "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {target}: no such directory" in err and "Traceback" not in err
    assert not target.parent.exists()


def test_simulate_warns_when_the_offered_load_swamps_the_deployment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = [
        "simulate",
        *KIMI,
        "--policy",
        "cost_model",
        "--workload",
        "poisson",
        "--output-tokens",
        "exp:200",
    ]
    # 20 requests/s x 200 tokens = 4000 tok/s against about 1100 tok/s of one plain + one EAGLE server
    assert main([*base, "--rate", "20", "--requests", "500"]) == 0
    err = capsys.readouterr().err
    assert "warning: cost_model on baseline=1,eagle=1: the offered load swamps the deployment" in err
    assert "output tok/s" in err and "not a steady state" in err and "--deployment" in err
    # a load the pair carries (docs/when-specroute-helps.md's 1 request/s) gets no such warning
    assert main([*base, "--rate", "1", "--requests", "300"]) == 0
    assert "swamps" not in capsys.readouterr().err
    # closed-loop sweeps bound their own load: never warned
    assert (
        main(
            [
                "simulate",
                *KIMI,
                "--policy",
                "cost_model",
                "--concurrency",
                "250",
                "--requests-per-level",
                "50",
            ]
        )
        == 0
    )
    assert "swamps" not in capsys.readouterr().err


def test_jsonl_trace_without_hash_ids_names_the_guessed_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 700, "output_length": 20}) + "\n")
    assert main(["simulate", *KIMI, "--workload", "trace", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "format was guessed as 'specroute-log'" in err and "needs 'ts'" in err
    assert "Mooncake's 'timestamp', 'input_length', 'output_length' but no 'hash_ids'" in err
    other = tmp_path / "o.jsonl"
    other.write_text(json.dumps({"time": 1, "tokens": 5}) + "\n")
    assert main(["simulate", *KIMI, "--workload", "trace", "--trace", str(other)]) == 2
    err = capsys.readouterr().err
    assert "guessed as 'specroute-log'" in err and "'time', 'tokens'" in err and "--trace-format" in err


SWAMPING = ["--workload", "poisson", "--output-tokens", "exp:200", "--rate", "20", "--requests", "400"]
"""20 requests/s x 200 tokens = 4000 tok/s against about 1100 tok/s of one plain + one EAGLE server."""


def test_tune_and_plan_warn_when_the_offered_load_swamps_the_deployment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`simulate`'s overload warning, from `tune` (its ranked points) and `plan` (its deployments)."""
    tune = ["tune", *KIMI, "--policy", "threshold", "--grid", "threshold=2,8", "--jobs", "1"]
    assert main([*tune, *SWAMPING, "--out", str(tmp_path / "t.yaml")]) == 0
    err = capsys.readouterr().err
    assert "warning: threshold on baseline=1,eagle=1 (threshold=" in err
    assert "the offered load swamps the deployment" in err and "(and 1 other grid point likewise)" in err
    plan = ["plan", *KIMI, "--servers", "2", "--loads", "1", "--jobs", "1", "--policies", "threshold"]
    assert main([*plan, *SWAMPING, "--out", str(tmp_path / "p.yaml")]) == 0
    err = capsys.readouterr().err
    assert "specroute plan: warning: at 1x load, " in err and "the offered load swamps the deployment" in err
    # a load the pair carries gets no such warning from either
    light = ["--workload", "poisson", "--rate", "1", "--requests", "200"]
    assert main([*tune, *light, "--out", str(tmp_path / "t2.yaml")]) == 0
    assert main([*plan, *light, "--out", str(tmp_path / "p2.yaml")]) == 0
    assert "swamps" not in capsys.readouterr().err


def _ranking_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rank"))
    return [ln.split() for ln in lines[start + 1 :] if ln.strip()[:1].isdigit()]


def test_tune_ranks_with_intervals_over_seeds_and_calls_ties(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every point runs on every seed: its score is a mean with a 95% interval, each margin to
    the next is a paired interval judged by the planner's tie rule, and a best point within the
    noise of others says so, in the output and in the config it writes."""
    out_file = tmp_path / "t.yaml"
    # at one request/s the eagle pool never holds 30 requests: both thresholds route alike
    args = ["tune", *KIMI, "--policy", "threshold", "--grid", "threshold=30,40", "--workload", "poisson",
            "--rate", "1", "--requests", "600", "--jobs", "1"]  # fmt: skip
    assert main([*args, "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "the mean over 3 seeds (0, 1, 2) with its 95% interval" in out
    assert "a margin inside its 95% interval or under 1% is a tie" in out
    rows = _ranking_rows(out)
    assert len(rows) == 2
    assert rows[0][3].startswith("±") and rows[0][-1] == "tie", rows  # mean ±half ... margin tie
    assert "within the noise of" in out and ": a tie ->" in out
    config = out_file.read_text()
    assert "(a tie, not a win)" in config and "mean over seeds 0, 1, 2" in config
    # a margin beyond the noise is a win, and the best then stands alone
    args = ["tune", *KIMI, "--policy", "threshold", "--grid", "threshold=1,48", "--workload", "poisson",
            "--rate", "3", "--requests", "600", "--jobs", "1", "--seeds", "0", "1", "2", "3"]  # fmt: skip
    assert main([*args, "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    rows = _ranking_rows(out)
    assert rows[0][-1] == "win" and "within the noise" not in out and "4 seeds (0, 1, 2, 3)" in out
    # one seed: no interval, and the output says so
    assert main([*args[:-5], "--seed", "5", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "one seed: no confidence interval" in out and "±" not in out


def test_a_replay_without_randomness_says_so_instead_of_zero_wide_intervals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A decision-log trace has every arrival and length: the seeds change nothing, so `tune` and
    `plan` say that each figure is one simulation's, and print no "±0"."""
    trace = tmp_path / "decisions.jsonl"
    lines = []
    for i in range(60):
        record = {"ts": 1000 + 0.5 * i, "prompt_tokens": 100, "max_tokens": 100, "completion_tokens": 60 + i}
        lines.append(json.dumps({**record, "hint": None, "status": "ok"}) + "\n")
    trace.write_text("".join(lines))
    replay = ["--workload", "trace", "--trace", str(trace), "--jobs", "1"]
    assert main(["tune", *KIMI, "--policy", "threshold", "--grid", "threshold=1,4", *replay,
                 "--out", str(tmp_path / "t.yaml")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "note: every grid point scored the same on each of the 3 seeds" in out
    assert "±" not in out
    assert main(["plan", *KIMI, "--servers", "1", "--loads", "1", *replay,
                 "--out", str(tmp_path / "p.yaml")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "note: every deployment scored the same on each of the 3 seeds" in out
    assert "±0" not in out and "[" not in out.split("== load 1x ==")[1].split("best:")[0]
    # a workload drawn from the seed gets neither the note nor missing intervals
    drawn = ["--workload", "poisson", "--rate", "2", "--requests", "300", "--jobs", "1"]
    assert main(["tune", *KIMI, "--policy", "threshold", "--grid", "threshold=1,4", *drawn,
                 "--out", str(tmp_path / "t.yaml")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "scored the same" not in out and "±" in out


def test_a_prompts_workload_without_accept_factors_explains_its_equal_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """HumanEval's lines carry no `accept`: every request's EAGLE speed is the profile's, so
    content-aware and content-blind cost_model route alike and print equal rows; simulate says
    why. Lines with accept factors get no such note."""
    plain = tmp_path / "plain.jsonl"
    told = tmp_path / "told.jsonl"
    lines = [("def f(x):\n    return x", 1.4), ("Write a poem about the sea.", 0.6)] * 10
    plain.write_text("".join(json.dumps({"prompt": text}) + "\n" for text, _ in lines))
    told.write_text("".join(json.dumps({"prompt": t, "accept": a}) + "\n" for t, a in lines))
    # exploration off: what content awareness adds beside it is what the rows compare
    base = ["simulate", *KIMI, "--workload", "prompts", "--rate", "1", "--requests", "300",
            "--policy", "cost_model:explore_budget=0",
            "--policy", "cost_model:content_aware=false"]  # fmt: skip
    assert main([*base, "--prompts", str(plain)]) == 0
    out, err = capsys.readouterr()
    rows = [ln.split("]", 1)[1].split() for ln in out.splitlines() if ln.startswith("cost_model")]
    assert len(rows) == 2 and rows[0] == rows[1]
    assert f"note: every request of {plain} has the same EAGLE speed factor" in err
    assert "give equal rows" in err and "`accept` factors" in err and "explore_budget" in err
    assert main([*base, "--prompts", str(told)]) == 0
    assert "same EAGLE speed factor" not in capsys.readouterr().err
