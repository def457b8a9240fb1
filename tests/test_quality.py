"""The code-quality gates run as tests, so the README's one test command checks them too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_clean() -> None:
    if shutil.which("ruff") is None:
        pytest.fail("ruff is not installed (pip install -e '.[dev]')")
    proc = _run(["ruff", "check", "controller", "policies", "simulator", "tests", "benchmarks"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_on_policies_and_simulator() -> None:
    proc = _run([sys.executable, "-m", "mypy", "--strict", "policies", "simulator"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
