"""The prompts workload: real request bodies from a JSONL file, with content features the policy
sees (the proxy's extractor) and a TRUE eagle factor it does not; `simulate`, `tune` and `plan`
take it; deterministic; bad files give a clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.cli import main
from policies.features import extract_features
from simulator.engine.workloads import WorkloadError, WorkloadSpec, generate

PROFILE = "kimi-k25-int4-8gpu"
CODE = "Complete the following Python function.\n\ndef add(a, b):\n    return a + b\n"
PROSE = "Explain monsoons to a curious student, with two facts and one common misconception."


def write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def prompts(tmp_path: Path) -> Path:
    lines: list[dict[str, Any]] = []
    for i in range(10):
        chat = [{"role": "user", "content": f"{CODE} # {i}"}]
        lines.append({"messages": chat, "accept": 1.5, "category": "code"})
        lines.append({"prompt": f"{PROSE} ({i})", "accept": 0.8, "output_tokens": 50, "temperature": 0.7})
    lines.append({"messages": [{"role": "user", "content": PROSE}], "hint": "prose"})
    return write(tmp_path / "p.jsonl", lines)


def test_batch_columns_follow_the_file(tmp_path: Path) -> None:
    path = prompts(tmp_path)
    spec = WorkloadSpec(kind="prompts", prompts=str(path), rate=2.0, requests=63)
    (seg,) = generate(spec, seed=3)
    b = seg.batch
    assert len(b) == 63 and b.arrivals is not None and list(b.arrivals) == sorted(b.arrivals)
    assert b.features is not None and len(b.features) == 63
    # every line appears exactly three times (63 = 3 x 21): one shuffled order, cycled
    assert len(set(b.features)) == 21 and all(list(b.features).count(f) == 3 for f in set(b.features))
    assert list(b.features[:21]) == list(b.features[21:42])
    code = extract_features({"messages": [{"role": "user", "content": f"{CODE} # 0"}]}, "chat")
    i = list(b.features).index(code)
    assert b.accept[i] == 1.5 and b.prompt_tokens[i] == len(f"{CODE} # 0") // 4
    assert b.output_tokens[i] == 200  # the default length draw
    prose = [k for k, f in enumerate(b.features) if f is not None and f.temperature == 0.7]
    assert prose and all(b.accept[k] == 0.8 and b.output_tokens[k] == 50 for k in prose)
    hinted = [k for k, h in enumerate(b.hints) if h is not None]
    assert len(hinted) == 3 and all(b.accept[k] == 1.0 for k in hinted)  # default accept 1
    # deterministic; another seed another order
    assert generate(spec, seed=3)[0].batch == b
    assert list(generate(spec, seed=4)[0].batch.features or []) != list(b.features)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "no requests"),
        ("{not json\n", "not JSON"),
        ('{"prompt": 3}\n', "needs 'messages'"),
        ('{"prompt": "x", "accept": 0}\n', "'accept' must be a number > 0"),
        ('{"prompt": "x", "output_tokens": 1.5}\n', "'output_tokens' must be an integer"),
        ('{"prompt": "x", "hint": 4}\n', "'hint' must be a string"),
        ("[1]\n", "expected a JSON object"),
    ],
)
def test_bad_files_name_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(WorkloadError, match=message):
        generate(WorkloadSpec(kind="prompts", prompts=str(path)), 0)
    with pytest.raises(WorkloadError, match="needs --prompts"):
        WorkloadSpec(kind="prompts")
    with pytest.raises(WorkloadError, match="cannot read"):
        generate(WorkloadSpec(kind="prompts", prompts=str(tmp_path / "missing.jsonl")), 0)


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc


def test_simulate_routes_by_content(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Content-aware cost_model learns that eagle pays for the code lines and not for the prose:
    its mean e2e beats the content-blind run's on the same requests, and it sends code to eagle."""
    path = prompts(tmp_path)
    common = [
        "simulate", "--profile", PROFILE, "--json", "--workload", "prompts", "--prompts", str(path),
        "--rate", "2", "--requests", "600", "--spec-details", "--policy", "cost_model",
        "--policy", "cost_model:content_aware=false",
    ]  # fmt: skip
    doc = run_json(capsys, *common)
    aware, blind = (r["summary"] for r in doc["runs"])
    assert aware["requests"] == blind["requests"] == 600
    assert aware["mean_e2e_s"] < blind["mean_e2e_s"]
    assert run_json(capsys, *common) == doc  # deterministic to the bit
    code = main(["simulate", "--profile", PROFILE, "--workload", "prompts"])
    err = capsys.readouterr().err
    assert code == 2 and "needs --prompts FILE" in err


def test_tune_and_plan_take_the_prompts_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = prompts(tmp_path)
    workload = ["--workload", "prompts", "--prompts", str(path), "--rate", "1", "--requests", "100"]
    code = main(
        ["tune", "--profile", PROFILE, "--policy", "cost_model", "--grid", "content_aware=true,false",
         *workload, "--objective", "mean_e2e_s", "--out", str(tmp_path / "best.yaml"), "--jobs", "1"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "best: cost_model" in out and (tmp_path / "best.yaml").exists()
    code = main(
        ["plan", "--profile", PROFILE, "--servers", "2", *workload, "--seeds", "0",
         "--policies", "cost_model", "--no-progress", "--out", str(tmp_path / "plan.yaml")]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert (tmp_path / "plan.yaml").exists()
