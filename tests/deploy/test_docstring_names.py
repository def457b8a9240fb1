"""Docs in the code that tell today's truth. Comments and docstrings carry no per-call cost or
probe-row name (those belong in commit messages), and every module docstring names only things
that exist: each dotted name it writes in backticks
(`policies.routing.Router`, `LoadTracker.view`, `forward.Forwarder`) is looked up.

A name is checked when its first part is something of ours or Python's: a module (absolute, or
relative to the docstring's package or its parent), a name the module defines or imports, a
builtin, or a top-level name defined anywhere in controller/, policies/ or simulator/. Then every
further part must exist: a module attribute, a class attribute, a dataclass or pydantic field, or
an attribute the class assigns (`self.NAME =`). Names whose first part is none of those are wire
formats or prose (`usage.prompt_tokens`, `policy.choose` of "a policy"), and file names (`x.py`)
are paths: neither is looked up."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("controller", "policies", "simulator")
DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")
_MISSING = object()


def _modules() -> list[tuple[str, Path]]:
    out = []
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name == "__main__.py":  # runs the command line when imported
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out.append((name, path))
    return out


@cache
def _top_level() -> dict[str, Any]:
    """Every top-level class of ours, by name (the first definition found)."""
    index: dict[str, Any] = {}
    for name, path in _modules():
        tree = ast.parse(path.read_text())
        defined = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
        if defined:
            module = importlib.import_module(name)
            for d in defined:
                index.setdefault(d, getattr(module, d))
    return index


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _assigned(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return True
        fields = getattr(klass, "model_fields", None)
        if isinstance(fields, dict) and name in fields:
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{name}\b\s*(:[^=\n]*)?=", source):
            return True
    return False


def _attribute(obj: Any, name: str) -> Any:
    """`obj.name`, or `_MISSING`; a class attribute its instances get in `__init__` counts
    (then the rest of the name is not looked up: `None` is returned)."""
    value = getattr(obj, name, _MISSING)
    if value is not _MISSING:
        return value
    if isinstance(obj, ModuleType):
        return _import(f"{obj.__name__}.{name}") or _MISSING
    if inspect.isclass(obj) and _assigned(obj, name):
        return None
    return _MISSING


def _head(first: str, module: ModuleType) -> Any:
    package = (
        module.__name__
        if module.__file__ and module.__file__.endswith("__init__.py")
        else (module.__name__.rpartition(".")[0])
    )
    for base in (None, package, package.rpartition(".")[0]):
        found = _import(first if not base else f"{base}.{first}")
        if found is not None:
            return found
    for space in (vars(module), vars(builtins), _top_level()):
        if first in space:
            return space[first]
    return _MISSING


def missing_names(name: str, path: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    module = importlib.import_module(name)
    missing = []
    for match in DOTTED.finditer(doc):
        if match.group(1).endswith(".py"):
            continue  # a file's name
        first, *rest = match.group(1).split(".")
        obj = _head(first, module)
        if obj is _MISSING:
            continue  # not a name of ours or Python's: a wire format or prose
        for part in rest:
            if obj is None:
                break
            obj = _attribute(obj, part)
            if obj is _MISSING:
                missing.append(match.group(1))
                break
    return missing


def test_every_dotted_name_in_a_module_docstring_exists() -> None:
    problems = {name: missing for name, path in _modules() if (missing := missing_names(name, path))}
    assert not problems, "\n".join(f"{name}: {', '.join(m)}" for name, m in problems.items())


def test_the_check_finds_a_name_that_is_gone(tmp_path: Path) -> None:
    """A docstring naming a module and a class attribute that do not exist is caught; prose and
    wire formats are not."""
    path = tmp_path / "sample.py"
    path.write_text(
        '"""`policies.view.no_such_builder`, `LoadView.no_such_field`, `usage.prompt_tokens`."""\n'
    )
    assert missing_names("policies.view", path) == ["policies.view.no_such_builder", "LoadView.no_such_field"]


COST = re.compile(r"\b\d[\d.,]*\s?(?:us|µs|ns)\b|\binstructions?\b|\brows? [A-Z]\d?\b")
"""A per-call cost in micro- or nanoseconds, an instruction count, a probe row ("row H")."""


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    out = [(i, line) for i, line in enumerate(source.splitlines(), 1) if "#" in line]
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.append((body[0].lineno, value.value))
    return out


def test_no_comment_or_docstring_states_a_per_call_cost() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}"
        for _, path in _modules()
        for line, text in _comments_and_docstrings(path)
        if (match := COST.search(text))
    ]
    assert not found, "\n".join(found)
