"""The container image (deploy/Dockerfile): its final stage runs `specroute serve` as non-root
with flags the CLI accepts, a HEALTHCHECK on the port it exposes; and the package `docker build`
installs (git's files minus deploy/Dockerfile.dockerignore, built as the image's `pip wheel`
builds it) holds every module and data file and runs the image's commands outside the checkout."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from deploy_files import (
    DEPLOY,
    ROOT,
    arg_value,
    check_specroute_command,
    clean_env,
    compose_value,
    dockerfile_instructions,
    final_stage,
    load_compose,
)

# --- the Dockerfile -------------------------------------------------------------------------------


def test_dockerfile_structure() -> None:
    final = final_stage(dockerfile_instructions())
    assert re.fullmatch(r"python:3\.1[1-9][\w.]*-slim(\S*)?", final[0][1].split()[0]), final[0]
    users = [rest for ins, rest in final if ins == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must run as non-root"
    (healthcheck,) = [rest for ins, rest in final if ins == "HEALTHCHECK"]
    assert "/health" in healthcheck
    for ins, rest in final:
        if ins == "COPY" and not rest.startswith("--from"):
            src = rest.split()[0]
            assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"
    ignored = {
        line.strip().rstrip("/")
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    needed = {
        "pyproject.toml", "constraints.txt", "controller", "policies", "simulator", "deploy",
        "deploy/specroute.yaml",
    }  # fmt: skip
    assert not ignored & needed, f"Dockerfile.dockerignore hides {ignored & needed}"


def test_the_image_installs_the_extras_of_every_command_run_from_it() -> None:
    """deploy/gateway's picker Deployment runs `specroute picker` from this image: the image's
    install (from the build stage's wheels, `--no-index`) names the `picker` extra, and the build
    stage made wheels for it, else the picker would fail at import in the cluster."""
    instructions = dockerfile_instructions()
    final = final_stage(instructions)
    installs = [rest for ins, rest in final if ins == "RUN" and "pip install" in rest]
    (install,) = installs
    assert "--no-index" in install and "--find-links /tmp/wheels" in install
    extras = {e for group in re.findall(r"specroute\[([\w,]+)\]", install) for e in group.split(",")}
    wheels = [rest for ins, rest in instructions[: len(instructions) - len(final)] if ins == "RUN"]
    built = {e for rest in wheels for group in re.findall(r"\.\[([\w,]+)\]", rest) for e in group.split(",")}
    picker = (DEPLOY / "gateway" / "kubernetes" / "picker-deployment.yaml").read_text()
    assert "image: specroute" in picker and '["specroute", "picker"]' in picker
    assert "picker" in extras and "picker" in built
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^picker = \[", pyproject, flags=re.M), "pyproject.toml has no picker extra"


def test_dockerfile_runs_specroute_serve_with_accepted_flags() -> None:
    final = final_stage(dockerfile_instructions())
    (entrypoint,) = [json.loads(rest) for ins, rest in final if ins == "ENTRYPOINT"]
    (cmd,) = [json.loads(rest) for ins, rest in final if ins == "CMD"]
    assert entrypoint == ["specroute", "serve"]
    check_specroute_command("serve", cmd, "Dockerfile CMD")
    port = arg_value(cmd, "--port")
    exposed = [rest for ins, rest in final if ins == "EXPOSE"]
    assert exposed == [port]
    (healthcheck,) = [rest for ins, rest in final if ins == "HEALTHCHECK"]
    assert f"127.0.0.1:{port}/health" in healthcheck
    assert arg_value(cmd, "--config") == "/etc/specroute/specroute.yaml"


# --- the image's package: what `docker build` installs (without Docker) -----------------------------


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Docker's .dockerignore glob: `*` and `?` stay within one path element, `**` spans any."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out, i = out + {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i])), i + 1
    return re.compile(out)


def _dockerignored() -> Callable[[str], bool]:
    """Is this context-relative path excluded by deploy/Dockerfile.dockerignore? A pattern that
    matches a directory excludes what is under it; a later `!pattern` line re-includes."""
    rules = []
    for raw in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), _glob_regex(line.removeprefix("!").strip("/"))))

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        result = False
        for negate, regex in rules:
            if any(regex.fullmatch(prefix) for prefix in prefixes):
                result = not negate
        return result

    return ignored


def test_dockerignore_matching_follows_docker_rules() -> None:
    ignored = _dockerignored()
    assert ignored("tests/test_deploy.py") and ignored("controller/__pycache__/app.cpython-311.pyc")
    assert ignored("specroute.egg-info/PKG-INFO") and ignored(".git/HEAD") and ignored("__pycache__/x.pyc")
    assert not ignored("controller/app.py") and not ignored("deploy/specroute.yaml")
    assert not ignored("pyproject.toml") and not ignored("README.md")


def test_image_package_holds_every_module_and_data_file(tmp_path: Path) -> None:
    """Build the package from the files `docker build` sends (git's files minus the
    .dockerignore) the way the image's `pip wheel` does (setuptools build_py: the wheel's
    contents for a pure-Python package), then run the image's commands from that build, outside
    the checkout: every module and data file (built-in profiles, bench prompts) is in it, and
    the copied config passes check-config with every profile the deploy files name."""
    pytest.importorskip("setuptools", reason="setuptools is not installed")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout.split("\0")
    ignored = _dockerignored()
    context = tmp_path / "context"
    for rel in filter(None, listed):
        if ignored(rel) or not (ROOT / rel).is_file():
            continue
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)
    lib = tmp_path / "lib"
    build = subprocess.run(
        [
            sys.executable,
            "-c",
            "import setuptools; setuptools.setup()",
            "-q",
            "build_py",
            "--build-lib",
            str(lib),
        ],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert build.returncode == 0, build.stderr[-3000:]

    packages = ("controller", "policies", "simulator")
    shipped = {rel for rel in listed if rel.split("/")[0] in packages}
    built = {str(f.relative_to(lib)) for f in lib.rglob("*") if f.is_file() and "__pycache__" not in f.parts}
    assert shipped - built == set(), "the image would lack these files"
    assert any(rel.endswith(".json") for rel in built) and any(rel.endswith(".jsonl") for rel in built)

    env = clean_env() | {"PYTHONPATH": str(lib)}
    where = subprocess.run(
        [sys.executable, "-c", "import controller, policies, simulator as s; print(s.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert where.returncode == 0 and where.stdout.startswith(str(lib)), where.stdout + where.stderr

    def run(*args: str, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "controller.cli", *args],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env | (extra or {}),
        )  # fmt: skip

    (config_copy,) = [
        rest.split()
        for ins, rest in final_stage(dockerfile_instructions())
        if ins == "COPY" and "specroute.yaml" in rest
    ]
    config = context / config_copy[0]
    profiles = {"kimi-k25-int4-8gpu"}
    for name in ("compose.yaml", "compose.emulated.yaml"):
        services = load_compose(name)["services"]
        profiles.add(compose_value(str(services["specroute"]["environment"]["SPECROUTE_PROFILE"])))
        for service in services.values():
            args = [compose_value(str(a)) for a in service.get("command") or []]
            if "--profile" in args and service.get("entrypoint", [""])[0] == "specroute":
                profiles.add(arg_value(args, "--profile"))
    assert len(profiles) >= 2
    for profile in sorted(profiles):
        proc = run("check-config", str(config), extra={"SPECROUTE_PROFILE": profile})
        assert proc.returncode == 0, f"profile {profile}: {proc.stdout[-500:]}{proc.stderr[-2000:]}"
    for command in ("serve", "emulate", "bench"):
        proc = run(command, "--help")
        assert proc.returncode == 0, proc.stderr[-2000:]
