"""The code-quality gates run as tests, so the README's one test command checks them too."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


FOLDERS = ["controller", "policies", "simulator", "tests", "benchmarks"]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m ruff ...` of this interpreter (no reliance on a `ruff` on the PATH)."""
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed (pip install -e '.[dev]')")
    return _run([sys.executable, "-m", "ruff", *args])


def test_ruff_clean() -> None:
    proc = _ruff("check", *FOLDERS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_clean() -> None:
    proc = _ruff("format", "--check", *FOLDERS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


STRICT = ["controller", "policies", "simulator"]
"""The packages `mypy --strict` must pass on (pyproject's [tool.mypy] packages)."""


def test_mypy_strict_on_controller_policies_and_simulator() -> None:
    proc = _run([sys.executable, "-m", "mypy", "--strict", *STRICT])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_config_covers_the_strict_packages() -> None:
    """A bare `mypy` (pyproject's config) checks the same packages as the test above."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]
    assert config["strict"] is True and sorted(config["packages"]) == STRICT


def test_mypy_strict_on_the_benchmarks() -> None:
    proc = _run([sys.executable, "-m", "mypy", "--strict", "benchmarks"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_on_the_tests(tmp_path: Path) -> None:
    """The tests type-check at mypy's default level (what is annotated is checked: the fakes, the
    helpers, the fixtures, the annotated tests). They import their helpers as top-level modules
    (`from helpers import ...`, `from deploy_files import ...`), so they are checked from tests/
    with the packages beside them through links, not from the checkout's root, where
    `tests/helpers.py` would be two modules. pyproject's untyped third-party packages apply."""
    packages = tmp_path / "packages"
    packages.mkdir()
    for name in STRICT:
        (packages / name).symlink_to(ROOT / name, target_is_directory=True)
    helpers = (
        p for p in (ROOT / "tests").glob("*/*.py") if not p.name.startswith(("test_", "_", "conftest"))
    )
    paths = [packages, *sorted({p.parent for p in helpers})]
    config_toml = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    untyped = [
        o["module"]
        for o in config_toml["tool"]["mypy"].get("overrides", [])
        if o.get("ignore_missing_imports")
    ]
    config = tmp_path / "mypy.ini"
    config.write_text(
        "[mypy]\npython_version = 3.11\nexplicit_package_bases = True\n"
        f"mypy_path = {':'.join(map(str, paths))}\ncache_dir = {tmp_path / 'cache'}\n"
        + "".join(f"[mypy-{','.join(modules)}]\nignore_missing_imports = True\n" for modules in untyped)
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "."],
        cwd=ROOT / "tests", capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
