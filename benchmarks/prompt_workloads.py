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

Task-type workloads (issue 33: generalization to task types never seen in training). Eight task
types, each from a public source read at run time from what is installed (nothing copied into
the repo):

- `code`: HumanEval (above); `math`: GSM8K (above; the next 250 questions); `prose`: the general set;
- `tools`: the Berkeley Function Calling Leaderboard (Patil et al., "The Berkeley Function Calling
  Leaderboard (BFCL)", 2024; Apache-2.0), its user question sent with its function definitions as
  OpenAI `tools`, read from the installed `bfcl-eval` wheel (`pip install --no-deps bfcl-eval`: its
  data folder only, none of its code is imported);
- `translate`: German, Italian, Spanish and Russian sayings from Debian's `fortunes-de`,
  `fortunes-it`, `fortunes-es`, `fortunes-ru` (GPL-2+; `apt-get install fortunes-de fortunes-it
  fortunes-es fortunes-ru`), behind one of four translation instructions;
- `summarize`, `extract`, `longqa`: passages of the Python Language Reference as CPython ships it
  (`pydoc_data.topics`, PSF License), cut into ~3,000-character documents (disjoint between the
  three types) behind summarising or extracting instructions, or followed by a short question.

A type whose source is not installed is left out with a message. Their true factors
(`TASK_FACTORS`): `code-drafter` continues the motivating deployment (a drafter trained on code and
agentic data: tool calls near code, translation of non-English text lowest); `published` takes the
Kimi drafter's figures above for code, math and prose and Spec-Bench's EAGLE speed-ups per task
(Xia et al., "Unlocking Efficiency in Large Language Model Inference", ACL Findings 2024,
github.com/hemingkx/Spec-Bench Leaderboard, A100, Vicuna-7B: multi-turn 2.67x, translation 1.99x,
summarisation 2.23x, QA 2.12x, RAG 2.04x) relative to its multi-turn figure for the others (tools:
no published figure, taken as code's); `uniform`: every type 1. Each line is also sent at a
temperature (none, 0, 0.7 or 1.0, seeded) and its factor scaled by `1 - 0.3 x temperature`:
acceptance falls with temperature (the EAGLE-3 paper's temperature-1 accept lengths are below its
greedy ones; the slope is this benchmark's assumption). `SPLITS` name the train / test splits by
task type that `benchmarks/content_routing.py --held-out` runs.

    python benchmarks/prompt_workloads.py --out /tmp/prompts      # writes SCENARIO.jsonl there
    python benchmarks/prompt_workloads.py --tasks --out /tmp/tasks  # the task-type files
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from collections.abc import Sequence
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


TASKS = ("code", "math", "prose", "tools", "translate", "summarize", "extract", "longqa")
_MT = 2.67  # Spec-Bench, EAGLE, A100, Vicuna-7B: multi-turn conversation speed-up
TASK_FACTORS: dict[str, dict[str, float]] = {
    "code-drafter": {
        "code": 1.5, "tools": 1.3, "math": 1.0, "extract": 1.0, "summarize": 0.9, "longqa": 0.9,
        "prose": 0.8, "translate": 0.6,
    },
    "published": {
        "code": 2.91 / 2.66, "math": 3.23 / 2.66, "prose": 1.0, "tools": 2.91 / 2.66,
        "translate": 1.99 / _MT, "summarize": 2.23 / _MT, "longqa": 2.12 / _MT, "extract": 2.04 / _MT,
    },
    "uniform": dict.fromkeys(TASKS, 1.0),
}  # fmt: skip
SPLITS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (task types trained on, task types tested on)
    "new-kinds": (("code", "math", "prose"), ("tools", "translate", "summarize", "extract", "longqa")),
    "old-kinds": (("tools", "translate", "summarize", "extract", "longqa"), ("code", "math", "prose")),
    "mixed": (("code", "tools", "summarize", "longqa"), ("math", "prose", "translate", "extract")),
}
TEMPERATURES: tuple[tuple[float | None, float], ...] = ((None, 0.4), (0.0, 0.2), (0.7, 0.25), (1.0, 0.15))
"""(temperature sent, share of lines): None sends none (the server's default, taken as greedy)."""
TEMPERATURE_SLOPE = 0.3
FORTUNES = Path("/usr/share/games/fortunes")
TRANSLATE_LANGS = ("de", "it", "es", "ru")
_TRANSLATE = (
    "Translate the following text into English:\n\n{text}",
    "Please translate this into English, keeping the tone:\n{text}",
    "{text}\n\nTranslate the text above into English.",
    "What does this mean in English?\n\n{text}",
)
_DOCS: dict[str, tuple[str, ...]] = {
    "summarize": (
        "Summarize the following section of the Python reference manual in three sentences.\n\n{doc}",
        "{doc}\n\nSummarise the text above for a newcomer, in at most five bullet points.",
        "TL;DR of this documentation:\n\n{doc}",
    ),
    "extract": (
        "Extract every Python keyword, built-in function and exception name mentioned in the text "
        "below, as a JSON list of strings.\n\n{doc}",
        "{doc}\n\nList all the code identifiers that appear in the text above, one per line.",
        "From the following documentation, extract each rule it states as a JSON array of "
        '{{"rule": ...}} objects.\n\n{doc}',
    ),
    "longqa": (
        "{doc}\n\nQuestion: according to the text above, what does Python do first here? One sentence.",
        "Read the documentation below and answer the question at the end.\n\n{doc}\n\n"
        "Which Python statement or construct is this about?",
        "{doc}\n\nIs any exception mentioned above? Answer yes or no, then name it.",
    ),
}
DOC_CHARS = 3000


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _bfcl_data() -> Path | None:
    """The data folder of the installed `bfcl-eval` wheel (its code is never imported)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "data"
    return folder if folder.is_dir() else None


_JSON_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string", "list": "array"}


def _schema(node: Any) -> Any:
    """BFCL's parameter schema in JSON Schema's type names (what OpenAI `tools` carry)."""
    if isinstance(node, dict):
        out = {k: _schema(v) for k, v in node.items()}
        if isinstance(out.get("type"), str):
            out["type"] = _JSON_TYPES.get(out["type"], out["type"])
        return out
    if isinstance(node, list):
        return [_schema(v) for v in node]
    return node


def tools_requests(limit: int = 250) -> list[dict[str, Any]]:
    folder = _bfcl_data()
    if folder is None:
        return []
    rows: list[dict[str, Any]] = []
    for name in ("simple_python", "multiple", "live_simple", "live_multiple"):
        for line in (folder / f"BFCL_v4_{name}.json").read_text(encoding="utf-8").splitlines():
            obj = json.loads(line)
            turn = obj["question"][0]
            tools = [
                {"type": "function", "function": {**f, "parameters": _schema(f.get("parameters", {}))}}
                for f in obj["function"]
            ]
            rows.append({"category": "tools", "messages": turn, "tools": tools})
    random.Random("tools").shuffle(rows)
    return rows[:limit]


def _fortunes(lang: str) -> list[str]:
    folder = FORTUNES / lang
    if not folder.is_dir():
        return []
    out: list[str] = []
    for f in sorted(folder.iterdir()):
        if (
            not f.is_file()
            or f.suffix == ".dat"
            or (f.suffix != ".u8" and f.with_name(f.name + ".u8").exists())
        ):
            continue
        if any(x in f.name for x in ("asciiart", "banner")):
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        out.extend(e.strip() for e in text.split("\n%\n") if 60 <= len(e.strip()) <= 500)
    return out


def translate_requests(per_lang: int = 60) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for lang in TRANSLATE_LANGS:
        rng = random.Random(f"translate/{lang}")
        texts = _fortunes(lang)
        rng.shuffle(texts)
        for text in texts[:per_lang]:
            rows.append(
                {"category": "translate", "messages": _chat(rng.choice(_TRANSLATE).format(text=text))}
            )
    return rows


def _documents() -> list[str]:
    """The Python Language Reference as CPython ships it, cut at paragraphs into documents of about
    DOC_CHARS characters (in a seeded order)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    docs: list[str] = []
    for key in sorted(topics):
        part = ""
        for para in topics[key].split("\n\n"):
            part = f"{part}\n\n{para}" if part else para
            if len(part) >= DOC_CHARS:
                docs.append(part[: 2 * DOC_CHARS])
                part = ""
        if len(part) >= DOC_CHARS // 2:
            docs.append(part)
    random.Random("documents").shuffle(docs)
    return docs


def document_requests() -> list[dict[str, Any]]:
    """`summarize`, `extract`, `longqa`: disjoint documents, each behind every template of its type."""
    rows: list[dict[str, Any]] = []
    kinds = tuple(_DOCS)
    for i, doc in enumerate(_documents()):
        kind = kinds[i % len(kinds)]
        rows.extend({"category": kind, "messages": _chat(t.format(doc=doc))} for t in _DOCS[kind])
    return rows


def task_requests(types: Sequence[str] = TASKS) -> list[dict[str, Any]]:
    """Every request of the task types asked for whose source is installed (see the module
    docstring), grouped by type in TASKS order."""
    shared = shared_dir()
    by: dict[str, list[dict[str, Any]]] = {
        "code": _read(shared / "humaneval.jsonl", "code"),
        "math": _read(shared / "gsm8k_train.jsonl", "math", 2 * GSM8K_LINES)[GSM8K_LINES:],
        "prose": _read(GENERAL, "prose"),
        "tools": tools_requests() if "tools" in types else [],
        "translate": translate_requests() if "translate" in types else [],
    }
    docs = document_requests() if {"summarize", "extract", "longqa"} & set(types) else []
    for kind in _DOCS:
        by[kind] = [r for r in docs if r["category"] == kind]
    missing = [t for t in types if not by[t]]
    if missing:
        print(
            f"task types left out (source not installed): {', '.join(missing)}; see "
            "benchmarks/prompt_workloads.py",
            file=sys.stderr,
        )
    return [r for t in TASKS if t in types for r in by[t]]


def build_tasks(
    scenario: str,
    *,
    types: Sequence[str] = TASKS,
    sigma: float,
    hints: bool,
    seed: int = 0,
    temperatures: bool = True,
) -> list[dict[str, Any]]:
    """The task-type lines of `types` for a scenario of TASK_FACTORS, each with its temperature
    (`temperatures` False: none sent, none applied)."""
    table = TASK_FACTORS[scenario]
    lines = task_requests(types)
    mean = 1.0
    if scenario in NORMALISED:  # normalised over every task type, so a split keeps its factors
        everything = task_requests() if tuple(types) != TASKS else lines
        mean = sum(table[r["category"]] for r in everything) / len(everything)
    rng = random.Random(f"{seed}/{scenario}/tasks")
    shares = [s for _, s in TEMPERATURES]
    out = []
    for r in lines:
        noise = rng.lognormvariate(-(sigma**2) / 2, sigma) if sigma > 0 else 1.0
        (temperature,) = rng.choices([t for t, _ in TEMPERATURES], shares)
        if not temperatures:
            temperature = None
        cooled = 1.0 - TEMPERATURE_SLOPE * (temperature or 0.0)
        line = dict(r, accept=round(table[r["category"]] / mean * cooled * noise, 4))
        if temperature is not None:
            line["temperature"] = temperature
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
    p.add_argument("--tasks", action="store_true", help="Write the task-type files (TASKS-SCENARIO.jsonl).")
    args = p.parse_args()
    if args.tasks:
        for scenario in TASK_FACTORS:
            lines = build_tasks(scenario, sigma=args.sigma, hints=False)
            path = args.out / f"tasks-{scenario}.jsonl"
            write(path, lines)
            counts = {t: sum(1 for x in lines if x["category"] == t) for t in TASKS}
            print(f"{path}: {len(lines)} requests {json.dumps(counts)}")
        return 0
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
