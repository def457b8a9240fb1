"""The repository's own documents stay true to the tree: every file path docs/*.md names exists
(or is marked as planned), and no source or document cites a document that is not in the
repository (the project's internal design notes): readers get `docs/` instead."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PATH = re.compile(
    r"`((?:controller|policies|simulator|tests|benchmarks|deploy|docs)/[\w./-]+\.(?:py|md|yaml|json))`"
)
OUTSIDE = re.compile(r"\b(DESIGN|SGLANG|STYLE)\.md\b")


def test_docs_name_only_files_that_exist() -> None:
    assert DOCS, "docs/ lost its documents"
    missing = []
    for doc in DOCS:
        for line in doc.read_text(encoding="utf-8").splitlines():
            for path in PATH.findall(line):
                if not (ROOT / path).exists() and "planned" not in line:
                    missing.append(f"{doc.name}: {path}")
    assert not missing, missing


def test_nothing_cites_documents_outside_the_repository() -> None:
    cited = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or path.suffix not in (".py", ".md", ".toml", ".yaml", ".yml"):
            continue
        if path == Path(__file__):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if OUTSIDE.search(line):
                cited.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert not cited, "cite docs/ARCHITECTURE.md or docs/SGLANG_PROTOCOL.md instead:\n" + "\n".join(cited)
