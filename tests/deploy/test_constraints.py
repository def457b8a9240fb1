"""constraints.txt, the pinned set CI, the Docker image and the README install: consistent with
pyproject.toml, closed under requirements, the versions the tests run with, and installable
into a fresh virtual environment (a `load` test; it needs the package index)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for number, raw in enumerate(CONSTRAINTS.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and name and version and ";" not in line, (
            f"constraints.txt:{number}: not NAME==VERSION: {raw!r}"
        )
        key = canonicalize_name(name)
        assert key not in pins, f"constraints.txt:{number}: {name} pinned twice"
        pins[key] = version.strip()
    return pins


def _project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project.get("optional-dependencies", {}).values():
        reqs += [Requirement(r) for r in extra]
    return reqs


def _applies(req: Requirement) -> bool:
    """The requirement holds here (its marker, with no extra requested)."""
    environment: dict[str, str] = {key: str(value) for key, value in default_environment().items()}
    environment["extra"] = ""
    return req.marker is None or req.marker.evaluate(environment)


def test_every_dependency_of_pyproject_is_pinned_within_its_bounds() -> None:
    pins = _pins()
    assert "specroute" not in pins  # the project itself is installed from the checkout
    for req in _project_requirements():
        if not _applies(req):
            continue
        key = canonicalize_name(req.name)
        assert key in pins, f"{req.name} ({req}) is in pyproject.toml but not pinned in constraints.txt"
        assert req.specifier.contains(pins[key], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[key]}, outside pyproject.toml's {req.specifier}"
        )


def test_the_pinned_set_is_closed_and_is_what_the_tests_run_with() -> None:
    """Every requirement of a pinned package is pinned too (else pip would take the newest), and
    this environment runs exactly the pinned versions (CI installs it from constraints.txt)."""
    pins = _pins()
    drift, unpinned = [], []
    for key, version in sorted(pins.items()):
        try:
            dist = metadata.distribution(key)
        except metadata.PackageNotFoundError:
            drift.append(f"{key}=={version} (not installed)")
            continue
        if dist.version != version:
            drift.append(f"{key}=={version} (installed {dist.version})")
        for text in dist.requires or []:
            req = Requirement(text)
            if _applies(req) and canonicalize_name(req.name) not in pins:
                unpinned.append(f"{req.name} (required by {key})")
    assert not unpinned, f"required but not pinned in constraints.txt: {', '.join(sorted(set(unpinned)))}"
    assert not drift, (
        f"this environment differs from constraints.txt: {', '.join(drift)}; reinstall with "
        "`pip install -c constraints.txt -e '.[dev]'`, or update the pins (docs/install.md)"
    )


_PROJECT_ARG = re.compile(r"""^['"]?(\.|\.\[[\w,]+\]|\S*\.whl|specroute\[[\w,]+\])['"]?$""")
"""A pip argument that installs specroute itself: `.`, `.[extra]` (quoted or not), a wheel, or
`specroute[extra]` (the image installs it from its own wheels, `--no-index`)."""


def _project_installs(text: str) -> list[str]:
    """Each `pip install` command of `text` (a shell script, Dockerfile or Markdown code block)
    whose arguments install specroute itself."""
    found = []
    for command in re.findall(r"pip install[^&\n]*", text.replace("\\\n", " ")):
        if any(_PROJECT_ARG.match(arg) for arg in command.split()[2:]):
            found.append(command.strip())
    return found


def _code_blocks(markdown: str) -> str:
    return "\n".join(re.findall(r"^```[a-z]*\n(.*?)^```", markdown, flags=re.M | re.S))


def test_ci_the_image_and_the_readme_install_through_the_pinned_set() -> None:
    """CI's install line (.ci/run), the image's (deploy/Dockerfile) and every install command of
    the READMEs' code blocks install specroute with `-c constraints.txt`: the pins are used, not
    only written down. The pages of docs/ may install specroute too, through the pins alike."""
    sources = {
        ".ci/run": (ROOT / ".ci" / "run").read_text(),
        "deploy/Dockerfile": (ROOT / "deploy" / "Dockerfile").read_text(),
        "README.md": _code_blocks((ROOT / "README.md").read_text()),
        "deploy/README.md": _code_blocks((ROOT / "deploy" / "README.md").read_text()),
    }
    docs = {f"docs/{p.name}": _code_blocks(p.read_text()) for p in sorted((ROOT / "docs").glob("*.md"))}
    for name, text in {**sources, **docs}.items():
        commands = _project_installs(text)
        assert commands or name in docs, f"{name}: no pip install of specroute found"
        for command in commands:
            assert re.search(r"(^|\s)-c \S*constraints\.txt(\s|$)", command), (
                f"{name}: {command!r} installs specroute without -c constraints.txt"
            )


def _index_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.mark.load
@pytest.mark.timeout(900)
def test_the_pinned_runtime_set_installs_into_a_fresh_venv(tmp_path: Path) -> None:
    """`pip install -c constraints.txt .` from a copy of the checkout (a build writes into the
    source tree), then `pip check`, the versions installed, and the command answering."""
    if not _index_reachable():
        pytest.skip("no route to the package index (pypi.org): the from-scratch install needs it")
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    src = tmp_path / "src"
    for name in files:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT", "VIRTUAL_ENV")}
    install = subprocess.run(
        [py, "-m", "pip", "install", "--disable-pip-version-check", "-q", "-c", "constraints.txt", "."],
        cwd=src, capture_output=True, text=True, timeout=840, env=env,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-4000:]
    check = subprocess.run([py, "-m", "pip", "check"], capture_output=True, text=True, timeout=120, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    pins = _pins()
    freeze = subprocess.run(
        [py, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    ).stdout.splitlines()
    installed = dict(line.split("==", 1) for line in freeze if "==" in line)
    for name, version in installed.items():
        key = canonicalize_name(name)
        if key != "specroute":
            assert pins.get(key) == version, (
                f"{name}=={version} installed, constraints.txt pins {pins.get(key)}"
            )
    assert {"aiohttp", "numpy", "pydantic"} <= {canonicalize_name(n) for n in installed}
    answer = subprocess.run(
        [str(venv / "bin" / "specroute"), "check-config", "deploy/specroute.yaml"],
        cwd=src, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert answer.returncode == 0, answer.stderr
