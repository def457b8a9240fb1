"""`specroute simulate` and `specroute tune` as users run them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import run_main

TRACES = Path("/work/shared/data/traces")
AZURE_CODE = TRACES / "AzureLLMInferenceTrace_code.csv"
SUMMARY_KEYS = {
    "requests",
    "mean_ttft_s",
    "p50_ttft_s",
    "p99_ttft_s",
    "mean_e2e_s",
    "p50_e2e_s",
    "p99_e2e_s",
    "mean_decode_tok_s",
    "throughput_tok_s",
    "pool_share",
}
PROFILE = "kimi-k25-int4-8gpu"


def sim_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code, out, err = run_main(capsys, "simulate", "--profile", PROFILE, "--json", *args)
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc


def check_summary(s: dict[str, Any]) -> None:
    assert set(s) >= SUMMARY_KEYS
    assert set(s["pool_share"]) == {"baseline", "eagle"}
    assert sum(s["pool_share"].values()) == pytest.approx(1.0)
    assert s["p50_e2e_s"] <= s["p99_e2e_s"]
    assert s["mean_ttft_s"] <= s["mean_e2e_s"]


def test_sweep_json_schema_and_side_by_side_policies(capsys: pytest.CaptureFixture[str]) -> None:
    doc = sim_json(
        capsys,
        "--policy", "threshold",
        "--policy", "fixed:pool=eagle",
        "--concurrency", "1", "10", "70",
        "--requests-per-level", "20",
    )  # fmt: skip
    runs = doc["runs"]
    assert [r["policy"] for r in runs] == ["threshold", "fixed"]
    assert runs[1]["params"] == {"pool": "eagle"}
    for r in runs:
        assert r["deployment"] == {"baseline": 1, "eagle": 1}
        check_summary(r["summary"])
        assert [lv["concurrency"] for lv in r["levels"]] == [1, 10, 70]
        for lv in r["levels"]:
            check_summary(lv)
        assert [lv["requests"] for lv in r["levels"]] == [20, 20, 20]
    eagle_only = runs[1]
    assert eagle_only["summary"]["pool_share"] == {"baseline": 0.0, "eagle": 1.0}
    # Alone on the server, a request decodes at the profile's concurrency-1 rate.
    assert eagle_only["levels"][0]["mean_decode_tok_s"] == pytest.approx(96.1, rel=1e-6)


def test_table_output_and_reference_deployments(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(
        capsys, "simulate", "--profile", PROFILE, "--policy", "threshold", "--concurrency", "5",
        "--deployment", "baseline=1,eagle=1", "--deployment", "adaptive=2", "--deployment", "baseline=2",
    )  # fmt: skip
    assert code == 0, err
    assert "threshold [baseline=1,eagle=1]" in out
    assert "least_loaded [adaptive=2]" in out
    assert "least_loaded [baseline=2]" in out
    assert "total tok/s" in out


def test_open_loop_workloads(capsys: pytest.CaptureFixture[str]) -> None:
    for kind in ("poisson", "bursty"):
        doc = sim_json(
            capsys, "--workload", kind, "--rate", "5", "--requests", "400",
            "--output-tokens", "lognormal:150,0.8", "--prompt-tokens", "exp:500",
        )  # fmt: skip
        run = doc["runs"][0]
        assert "levels" not in run
        assert run["summary"]["requests"] == 400
        check_summary(run["summary"])


def test_azure_trace_replay_detects_the_format(capsys: pytest.CaptureFixture[str]) -> None:
    if not AZURE_CODE.is_file():
        pytest.skip("Azure trace not available")
    doc = sim_json(capsys, "--workload", "trace", "--trace", str(AZURE_CODE), "--requests", "2000")
    s = doc["runs"][0]["summary"]
    assert s["requests"] == 2000
    check_summary(s)
    faster = sim_json(
        capsys, "--workload", "trace", "--trace", str(AZURE_CODE), "--requests", "2000",
        "--trace-format", "azure", "--time-scale", "0.25",
    )["runs"][0]["summary"]  # fmt: skip
    assert faster["mean_e2e_s"] > s["mean_e2e_s"]  # four times the arrival rate


def decision_log_lines() -> list[dict[str, Any]]:
    lines = []
    for i in range(60):
        lines.append(
            {
                "ts": 1_700_000_000.0 + 0.25 * i,
                "endpoint": "chat",
                "stream": True,
                "prompt_tokens": 100 + i,
                "max_tokens": 300 if i % 3 else None,
                "hint": "code" if i % 2 else None,
                "load": {},
                "policy": "threshold",
                "pool": "eagle",
                "backend": "eagle-0",
                "reason": "below_threshold",
                "predicted_ttft_s": {"eagle": 0.2},
                "predicted_e2e_s": {"eagle": 2.0},
                "ttft_s": 0.2,
                "completion_tokens": None if i % 5 == 0 else 50 + i,
                "duration_s": 1.0,
                "status": "ok",
            }
        )
    lines.reverse()  # written in finishing order, not arrival order
    return lines


def test_decision_log_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "decisions.jsonl"
    log.write_text("\n".join(json.dumps(x) for x in decision_log_lines()) + "\n")
    doc = sim_json(capsys, "--workload", "trace", "--trace", str(log), "--hint-accept", "code=1.3")
    assert doc["runs"][0]["summary"]["requests"] == 60


def test_policy_specs_with_inline_params_and_plugin_paths() -> None:
    from controller.cli.simulate import parse_policy

    assert parse_policy("threshold", {"threshold": 4}).params == {"threshold": 4}
    inline = parse_policy("threshold:threshold=16,signal=local", {"threshold": 4})
    assert (inline.name, dict(inline.params)) == ("threshold", {"threshold": 16, "signal": "local"})
    plugin = parse_policy("my.module:MyPolicy", {})
    assert (plugin.name, dict(plugin.params)) == ("my.module:MyPolicy", {})
    plugin = parse_policy("my.module:MyPolicy:k=1.5", {})
    assert (plugin.name, dict(plugin.params)) == ("my.module:MyPolicy", {"k": 1.5})


def test_json_is_byte_identical_across_processes(tmp_path: Path) -> None:
    args = [
        sys.executable, "-m", "controller.cli", "simulate", "--profile", PROFILE, "--json",
        "--workload", "bursty", "--rate", "8", "--requests", "1500", "--output-tokens", "exp:120",
        "--hint-mix", "code=1,prose=2", "--hint-accept", "code=1.2,prose=0.9", "--accept-sigma", "0.2",
        "--policy", "threshold", "--policy", "cost_model", "--seed", "42",
    ]  # fmt: skip
    outs = [
        subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout for _ in range(2)
    ]
    assert outs[0] == outs[1]
    assert json.loads(outs[0])["runs"][0]["summary"]["requests"] == 1500


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--profile", "no-such-profile"], "no built-in profile"),
        (["--profile", PROFILE, "--policy", "nope"], "unknown policy 'nope'"),
        (["--profile", PROFILE, "--policy", "threshold:threshold=-3"], "threshold"),
        (["--profile", PROFILE, "--output-tokens", "exp:abc"], "length spec"),
        (["--profile", PROFILE, "--deployment", "turbo=2"], "unknown server kind"),
        (["--profile", PROFILE, "--workload", "trace"], "--trace FILE"),
        (["--profile", PROFILE, "--workload", "trace", "--trace", "/nonexistent.csv"], "no such trace"),
        (["--profile", PROFILE, "--workload", "poisson", "--rate", "0"], "rate"),
        (["--profile", PROFILE, "--adaptive-ladder", "8:x"], "adaptive-ladder"),
        (["--profile", PROFILE, "--policy-param", "oops"], "KEY=VALUE"),
    ],
)
def test_bad_input_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _out, err = run_main(capsys, "simulate", *args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_bad_trace_lines_name_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "bad.jsonl"
    log.write_text('{"ts": 1.0, "prompt_tokens": 5, "completion_tokens": 3}\n{"ts": "x"}\n')
    code, _, err = run_main(
        capsys, "simulate", "--profile", PROFILE, "--workload", "trace", "--trace", str(log)
    )
    assert code == 2
    assert "bad.jsonl:2" in err
    csv = tmp_path / "bad.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,10,x\n")
    code, _, err = run_main(
        capsys, "simulate", "--profile", PROFILE, "--workload", "trace", "--trace", str(csv)
    )
    assert code == 2
    assert "bad.csv:2" in err


def test_report_writes_markdown_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    code, _, err = run_main(
        capsys, "simulate", "--profile", PROFILE, "--policy", "threshold", "--policy", "fixed",
        "--concurrency", "1", "10", "--report", str(tmp_path / "rep"),
    )  # fmt: skip
    assert code == 0, err
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "threshold" in md and "latency.png" in md
    for png in ("latency.png", "throughput.png"):
        assert (tmp_path / "rep" / png).read_bytes()[:4] == b"\x89PNG"


def tune_args(out: Path, jobs: int) -> list[str]:
    return [
        "tune", "--profile", PROFILE, "--policy", "threshold", "--grid", "threshold=2,8,32",
        "--grid", "hysteresis=0,1", "--workload", "sweep", "--concurrency", "1", "10", "70",
        "--requests-per-level", "20", "--objective", "mean_e2e_s", "--out", str(out), "--jobs", str(jobs),
    ]  # fmt: skip


def test_tune_ranks_and_writes_a_serve_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, *tune_args(tmp_path / "best.yaml", 1))
    assert code == 0, err
    assert "rank" in out and "best: threshold" in out
    config = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert config["policy"] == "threshold"
    assert set(config["policy_params"]) == {"threshold", "hysteresis"}
    assert isinstance(config["policy_params"]["threshold"], int)
    assert config["profile"] == PROFILE
    # The proxy's own config loader accepts the file unchanged.
    from controller.proxy import config as proxy_config

    settings = proxy_config.load_settings(
        {"baseline": ["http://127.0.0.1:1"], "eagle": ["http://127.0.0.1:2"]}, {}, tmp_path / "best.yaml"
    )
    assert settings.policy == "threshold"
    assert settings.policy_params == config["policy_params"]


def test_tune_is_identical_whatever_the_number_of_jobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out1, err = run_main(capsys, *tune_args(tmp_path / "a.yaml", 1))
    assert code == 0, err
    code, out2, err = run_main(capsys, *tune_args(tmp_path / "b.yaml", 2))
    assert code == 0, err
    assert out1.replace("a.yaml", "x") == out2.replace("b.yaml", "x")
    body = [(tmp_path / f).read_text().split("\n", 2)[2] for f in ("a.yaml", "b.yaml")]
    assert body[0] == body[1]


def test_tune_goodput_needs_an_slo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = tune_args(tmp_path / "g.yaml", 1)
    args[args.index("mean_e2e_s")] = "goodput"
    code, _, err = run_main(capsys, *args)
    assert code == 2 and "--slo-ttft" in err
    code, out, err = run_main(capsys, *args, "--slo-ttft", "0.3", "--slo-tpot", "0.05")
    assert code == 0, err
    assert "higher is better" in out


def test_tune_skips_combinations_the_policy_rejects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [
        "tune", "--profile", PROFILE, "--policy", "threshold", "--concurrency", "1", "10",
        "--requests-per-level", "10", "--jobs", "1",
    ]  # fmt: skip
    out_file = tmp_path / "t.yaml"
    # threshold's hysteresis must be smaller than its threshold: (1, 1) is not a valid point
    code, out, err = run_main(
        capsys, *base, "--grid", "threshold=1,2", "--grid", "hysteresis=0,1", "--out", str(out_file)
    )
    assert code == 0, err
    ranks = [line for line in out.splitlines() if line.lstrip()[:1].isdigit()]
    assert len(ranks) == 3 and not any("threshold=1,hysteresis=1" in r for r in ranks)
    assert "warning: grid point threshold=1,hysteresis=1 skipped" in err
    assert yaml.safe_load(out_file.read_text())["policy_params"]["hysteresis"] in (0, 1)
    # a value valid in no combination is still the user's error
    code, _, err = run_main(capsys, *base, "--grid", "threshold=0,2", "--out", str(tmp_path / "u.yaml"))
    assert code == 2 and "--grid threshold=0 is valid in no combination" in err
    assert "grid points" not in err  # reported before the progress bar starts
    code, _, err = run_main(
        capsys, *base, "--grid", "threshold=1", "--grid", "hysteresis=1", "--out", str(tmp_path / "v.yaml")
    )
    assert code == 2 and "hysteresis must be smaller than threshold" in err
    assert not (tmp_path / "u.yaml").exists() and not (tmp_path / "v.yaml").exists()


def test_tune_out_below_a_file_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("")
    args = tune_args(blocker / "best.yaml", 1)
    code, _, err = run_main(capsys, *args)
    assert code == 2 and f"cannot write {blocker / 'best.yaml'}: {blocker} is not a directory" in err


def test_every_option_of_the_simulator_bench_and_demo_commands_has_help() -> None:
    import argparse

    from controller.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("emulate", "demo", "simulate", "tune", "plan", "bench", "compare"):
        parser = sub.choices[name]
        missing = [a.option_strings or [a.dest] for a in parser._actions if not a.help]
        assert missing == [], (name, missing)
