"""The README's and docs/'s examples work as written: the quick start matches CI, every
`specroute` command line parses, the offline ones run, and the emulator + proxy + Python client
example runs for real (its fixed ports swapped for free ones). The README is the short page a
newcomer reads first: every page of docs/ is linked from it and every link resolves."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_files import registered_metrics
from helpers import free_port

from controller.cli import build_parser, spawn

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# Every document whose examples must run: the README, docs/ and the deployment guide.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
SETTINGS_PAGE = ROOT / "docs" / "configuration.md"
METRICS_PAGE = ROOT / "docs" / "metrics.md"
SGLANG_PAGE = ROOT / "docs" / "sglang.md"
OFFLINE = {"simulate", "tune", "plan", "policies", "check-config"}


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _blocks(lang: str, documents: list[Path] = DOCUMENTS) -> list[str]:
    return [b for doc in documents for b in re.findall(rf"```{lang}\n(.*?)```", _read(doc), flags=re.S)]


def _commands(block: str) -> list[str]:
    """Logical command lines of a shell block: continuations joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.split(" #")[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _specroute_lines() -> list[str]:
    out = []
    for block in _blocks("bash"):
        for cmd in _commands(block):
            for part in cmd.split("&&"):
                part = part.strip().removesuffix("&").strip()
                if part.startswith("specroute "):
                    out.append(part)
    return out


def _emulated_stack_block() -> str:
    return next(b for b in _blocks("bash", [SGLANG_PAGE]) if "specroute emulate" in b and "127.0.0.1" in b)


def test_quick_start_is_two_commands_and_ci_runs_the_test_one() -> None:
    section = README.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block is not None
    commands = _commands(block.group(1))
    assert len(commands) == 2
    assert commands[0].endswith("specroute demo")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert commands[1] in ci.splitlines()


def test_every_setting_is_named_in_the_configuration_page() -> None:
    from controller.proxy.config import Settings

    page = _read(SETTINGS_PAGE)
    missing = [key for key in Settings.model_fields if f"`{key}`" not in page]
    assert not missing, f"{SETTINGS_PAGE.name} does not mention settings {missing}"


def test_every_metric_is_in_the_metrics_table() -> None:
    """Every metric a live `specroute serve` registers is a row of docs/metrics.md's table."""
    names = registered_metrics()
    assert len(names) >= 40
    table = set(re.findall(r"^\| `(specroute_[a-z_]+)`", _read(METRICS_PAGE), flags=re.M))
    missing = sorted(names - table)
    assert not missing, f"{METRICS_PAGE.name}'s table lacks {missing}"
    assert not table - names, f"{METRICS_PAGE.name} lists metrics nobody registers: {sorted(table - names)}"


def test_every_documented_config_loads_and_builds_its_policy() -> None:
    """Each YAML example that is a specroute config (it names backends) is valid as written:
    the real loader takes it and its policy builds."""
    from controller.proxy.app import policy_context
    from controller.proxy.config import load_settings
    from policies.registry import default_registry

    configs = [b for b in _blocks("yaml") if re.search(r"^baseline:", b, flags=re.M)]
    assert len(configs) >= 2
    for block in configs:
        settings = load_settings({}, {}, "docs example", config_text=block)
        default_registry(entry_points=False).create(
            settings.policy, settings.policy_params, policy_context(settings)
        )


def test_every_specroute_line_parses() -> None:
    lines = _specroute_lines()
    assert len(lines) >= 12
    parser = build_parser()
    for line in lines:
        argv = shlex.split(line)[1:]
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # argparse reports the problem on stderr
            pytest.fail(f"documented line does not parse ({e.code}): {line}")
        assert getattr(args, "func", None) is not None, line


@pytest.mark.parametrize("line", [line for line in _specroute_lines() if shlex.split(line)[1] in OFFLINE])
def test_offline_examples_run(line: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "controller.cli", *shlex.split(line)[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip()


def test_emulator_ports_agree_with_the_example_config() -> None:
    """The documented emulators listen where deploy/specroute.yaml (and the systemd units) expect
    the two SGLang servers, so `serve --config deploy/specroute.yaml` finds them."""
    block = _emulated_stack_block()
    parser = build_parser()
    args = [parser.parse_args(shlex.split(c.removesuffix("&").strip())[1:]) for c in _commands(block)]
    emulated = {a.mode: a.port for a in args if a.func.__module__.endswith("emulate")}
    serve = next(a for a in args if a.func.__module__.endswith("serve"))
    config = yaml.safe_load((ROOT / "deploy" / "specroute.yaml").read_text(encoding="utf-8"))
    for pool in ("baseline", "eagle"):
        expected = [urlsplit(u.rpartition("=")[2]).port for u in config[pool]]  # [name=]url
        assert expected == [emulated[pool]] == [urlsplit(u).port for u in getattr(serve, pool)], pool


@pytest.fixture
def readme_stack() -> Iterator[int]:
    """Run docs/sglang.md's emulate/serve block with free ports; yield the proxy port."""
    block = _emulated_stack_block()
    ports = {"30000": str(free_port()), "30001": str(free_port()), "8000": str(free_port())}
    procs: list[subprocess.Popen[str]] = []
    try:
        for cmd in _commands(block):
            cmd = cmd.removesuffix("&").strip()
            for old, new in ports.items():
                cmd = re.sub(rf"(?<=[:\s]){old}\b", new, cmd)
            proc = subprocess.Popen(
                [sys.executable, "-m", "controller.cli", *shlex.split(cmd)[1:]],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                # the teardown's SIGTERM need not wait serve's 5 s grace (no balancer here)
                env={**os.environ, "PYTHONUNBUFFERED": "1", "SPECROUTE_SHUTDOWN_GRACE_S": "0"},
            )
            procs.append(proc)
            spawn.read_listening_sync(proc, timeout_s=60, what=cmd)
        yield int(ports["8000"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_client_example_runs_against_the_emulated_stack(readme_stack: int) -> None:
    code = next(b for b in _blocks("python", [SGLANG_PAGE]) if "OpenAI(" in b)
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{readme_stack}")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(proc.stdout.strip()) > 0  # the emulator's synthetic tokens, streamed through


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_examples_are_ruff_formatted(index: int) -> None:
    """Each Python block, fed to `ruff format --check` as a Python file (so any ruff version
    checks it, with or without its Markdown support), is formatted as the code folders are."""
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed (pip install -e '.[dev]')")
    block = _blocks("python")[index]
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--diff", "--stdin-filename", "doc_example.py", "-"],
        input=block, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_resolves() -> None:
    """A link in the README or docs/ to a file of this repository points at one that exists
    (pages moved between the README and docs/ keep their readers)."""
    broken = []
    for doc in DOCUMENTS:
        for target in LINK.findall(_read(doc)):
            if urlsplit(target).scheme or target.startswith("#"):
                continue
            if not (doc.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t).resolve() for t in LINK.findall(README) if not urlsplit(t).scheme}
    orphans = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not orphans, f"docs/ pages the README does not link: {orphans}"


def test_readme_up_to_how_it_works_reads_in_five_minutes() -> None:
    """What a newcomer reads first (introduction, Quick start, How it works) stays under 1,000
    words: five minutes at a careful 200 words a minute. The rest belongs in docs/."""
    assert "## How it works" in README
    head = README.split("## How it works", 1)[0] + README.split("## How it works", 1)[1].split("\n## ", 1)[0]
    words = len(head.split())
    assert 150 < words <= 1000, words
