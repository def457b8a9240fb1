"""Build the development prompts workloads (issue 24) from the shared public prompt sets.

Requests: HumanEval (164 code prompts; Chen et al. 2021, MIT) and the first 250 GSM8K train
questions (math; Cobbe et al. 2021, MIT), read from `../shared/data/prompts/` (never copied
into the repo; see SOURCES.md there), and the project's general prose set
(`controller/bench/prompt_sets/general.jsonl`, 254 prompts). Each line gets a `category` and
`accept`, its TRUE EAGLE speed factor relative to the profile's, from one of these scenarios:

- `published`: per-task EAGLE-3 average acceptance lengths published for a Kimi drafter,
  AQ-MedAI/Kimi-K2.7-Code-eagle3 (https://huggingface.co/AQ-MedAI/Kimi-K2.7-Code-eagle3, model
  card, SGLang, 3 steps, topk 1, 4 draft tokens): HumanEval 2.91, GSM8K 3.23, MT-bench 2.66 (our
  prose stands in for MT-bench's dialogue). Other published per-task figures show the same kind
  of spread: AQ-MedAI/Qwen3.5-397B-A17B-eagle3 (MT-Bench 3.03, GSM8K 3.40, HumanEval 3.47 at
  batch 1) and AQ-MedAI/Kimi-K2-Instruct-eagle3 (throughput +24% on MT-Bench to +80% on
  Math500 over the base model at batch 8).
- `code-drafter`: the motivating deployment, a drafter trained on code and agentic data with
  "artificially low acceptance" on general prompts (issue 24): code 1.5, math 1.0, prose 0.8.
- `uniform`: acceptance that does not depend on content (every factor 1).

The published accept lengths are normalised so that their mean over the file is 1 (the profile's
accept length was measured on a mixed prompt set); the code-drafter factors are relative to the
profile, as in the issue's measurement (mean 1.09 over this file). Each request's factor gets a
seeded lognormal spread (`--sigma`, default 0.08: the same prompt keeps its factor when the
workload cycles through the file). The `SCENARIO-hints.jsonl` files carry each line's category as
its `hint` (the "hints told" runs).

    python benchmarks/prompt_workloads.py --out /tmp/prompts      # writes SCENARIO.jsonl there
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent.parent / "shared" / "data" / "prompts"
if not SHARED.is_dir():  # a worktree lives one level deeper than a clone's checkout
    SHARED = ROOT.parent / "shared" / "data" / "prompts"
GENERAL = ROOT / "controller" / "bench" / "prompt_sets" / "general.jsonl"

ACCEPT_LENGTHS: dict[str, dict[str, float]] = {
    # AQ-MedAI/Kimi-K2.7-Code-eagle3 model card: HumanEval, GSM8K, MT-bench
    "published": {"code": 2.91, "math": 3.23, "prose": 2.66},
    "code-drafter": {"code": 1.5, "math": 1.0, "prose": 0.8},
    "uniform": {"code": 1.0, "math": 1.0, "prose": 1.0},
}
SCENARIOS = tuple(ACCEPT_LENGTHS)
NORMALISED = ("published",)
"""Published accept lengths are made relative to their mean; the other scenarios' factors are
relative to the profile already."""
GSM8K_LINES = 250


def shared_dir() -> Path:
    for candidate in (SHARED, Path("/work/shared/data/prompts")):
        if candidate.is_dir():
            return candidate
    raise SystemExit(f"cannot find the shared prompt sets (looked in {SHARED})")


def _read(path: Path, category: str, limit: int | None = None) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            obj = json.loads(line)
            out.append({"category": category, "messages": obj["messages"]})
            if limit is not None and len(out) >= limit:
                break
    return out


def requests() -> list[dict[str, Any]]:
    shared = shared_dir()
    return (
        _read(shared / "humaneval.jsonl", "code")
        + _read(shared / "gsm8k_train.jsonl", "math", GSM8K_LINES)
        + _read(GENERAL, "prose")
    )


def build(scenario: str, *, sigma: float, hints: bool, seed: int = 0) -> list[dict[str, Any]]:
    """The scenario's lines (see the module docstring)."""
    table = ACCEPT_LENGTHS[scenario]
    lines = requests()
    mean = sum(table[r["category"]] for r in lines) / len(lines) if scenario in NORMALISED else 1.0
    rng = random.Random(f"{seed}/{scenario}")
    out = []
    for r in lines:
        noise = rng.lognormvariate(-(sigma**2) / 2, sigma) if sigma > 0 else 1.0
        line = dict(r, accept=round(table[r["category"]] / mean * noise, 4))
        if hints:
            line["hint"] = r["category"]
        out.append(line)
    return out


def write(path: Path, lines: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/specroute-prompts"), help="Output folder.")
    p.add_argument("--sigma", type=float, default=0.08, help="Per-request lognormal spread of the factor.")
    args = p.parse_args()
    for scenario in SCENARIOS:
        for hints in (False, True):
            lines = build(scenario, sigma=args.sigma, hints=hints)
            path = args.out / f"{scenario}{'-hints' if hints else ''}.jsonl"
            write(path, lines)
            means = {
                c: sum(x["accept"] for x in lines if x["category"] == c)
                / sum(1 for x in lines if x["category"] == c)
                for c in ("code", "math", "prose")
            }
            rounded = {k: round(v, 3) for k, v in means.items()}
            print(f"{path}: {len(lines)} requests, mean accept {json.dumps(rounded)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
