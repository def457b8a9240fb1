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


TOKEN = re.compile(r"`([^`\s]+)`")


def test_the_tests_security_md_names_exist() -> None:
    """Every test SECURITY.md names as holding a promise (`file.py::test`, `::test` for the file
    named last, or `file.py`: `test`) is a test function in that file: a renamed or removed test
    cannot leave a promise pointing at nothing."""
    files = {p.name: p for p in (ROOT / "tests").rglob("test_*.py")}
    text = (ROOT / "SECURITY.md").read_text(encoding="utf-8")
    current: Path | None = None
    named, missing = 0, []
    for token in TOKEN.findall(text):
        path, sep, name = token.partition("::")
        if path.endswith(".py") and Path(path).name.startswith("test_"):
            current = files.get(Path(path).name)
            if current is None:
                missing.append(token)
                continue
            if not sep:
                continue
        elif not (sep and not path) and not re.fullmatch(r"test_\w+", token):
            continue
        name = name or token
        named += 1
        function = re.escape(name.split("[")[0])
        source = current.read_text(encoding="utf-8") if current is not None else ""
        if not re.search(rf"^(async )?def {function}\(", source, flags=re.M):
            missing.append(f"{current.name if current else '?'}::{name}")
    assert named >= 20, named
    assert not missing, missing
