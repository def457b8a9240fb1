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
