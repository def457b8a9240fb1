"""Top-level help: `specroute --help`, `--version`, bare `specroute` and every command's `--help`
print their usage and exit as argparse does (0 for --help and --version, 2 for a missing command),
with no traceback."""

from __future__ import annotations

import pytest
from helpers import run_specroute

from controller.cli import COMMANDS


async def test_top_level_help_lists_every_command() -> None:
    code, out, err = await run_specroute("--help")
    assert code == 0, err
    assert "Traceback" not in err
    for command in COMMANDS:
        assert command.name in out
    assert "95% CIs" in out  # the literal percent sign of bench's help line, printed as written


async def test_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    code, out, err = await run_specroute("--version")
    assert code == 0 and err == ""
    assert out.strip() == f"specroute {version('specroute')}"
    code, out, _ = await run_specroute("--help")
    assert "--version" in out


async def test_bare_specroute_prints_usage_and_exits_2() -> None:
    code, out, err = await run_specroute()
    assert code == 2
    assert "Traceback" not in err
    assert "usage: specroute" in out
    assert "serve" in out and "bench" in out


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
async def test_every_command_help(name: str) -> None:
    code, out, err = await run_specroute(name, "--help")
    assert code == 0, err
    assert "Traceback" not in err
    assert out.startswith(f"usage: specroute {name}")
