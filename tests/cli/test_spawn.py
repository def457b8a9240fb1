"""`controller.cli.spawn`, the one "start a child, wait for its listening line" helper of the demo,
the tests and the benchmarks: it skips earlier lines, and a child that ends or stays silent is
killed and reported with what it said."""

from __future__ import annotations

import subprocess
import sys

import pytest

from controller.cli import spawn

TALKS_FIRST = "print('loading', flush=True); print('x listening on http://127.0.0.1:5', flush=True); input()"
DIES = "import sys; print('no luck', file=sys.stderr, flush=True); sys.exit(3)"
SILENT = "import time; time.sleep(60)"


async def test_the_listening_line_after_other_lines() -> None:
    proc, line = await spawn.start([sys.executable, "-c", TALKS_FIRST], stdin=subprocess.PIPE)
    try:
        assert line == "x listening on http://127.0.0.1:5"
        assert spawn.url_of(line) == "http://127.0.0.1:5"
        assert proc.returncode is None
    finally:
        proc.kill()
        await proc.wait()


async def test_a_child_that_ends_is_reported_with_its_stderr() -> None:
    with pytest.raises(spawn.StartError, match=r"ended.*no luck"):
        await spawn.start([sys.executable, "-c", DIES])


async def test_a_silent_child_is_killed_at_the_deadline() -> None:
    with pytest.raises(spawn.StartError, match=r"no listening line within 0\.5 s"):
        await spawn.start([sys.executable, "-c", SILENT], timeout_s=0.5)


def test_the_sync_flavour_follows_the_same_rules() -> None:
    proc, line = spawn.start_sync([sys.executable, "-c", TALKS_FIRST], stdin=subprocess.PIPE)
    try:
        assert spawn.url_of(line) == "http://127.0.0.1:5"
    finally:
        assert spawn.stop_sync(proc) != 0  # terminated: it was still waiting for input
    with pytest.raises(spawn.StartError, match=r"ended.*no luck"):
        spawn.start_sync([sys.executable, "-c", DIES])
    with pytest.raises(spawn.StartError, match=r"no listening line within 0\.5 s"):
        spawn.start_sync([sys.executable, "-c", SILENT], timeout_s=0.5)
