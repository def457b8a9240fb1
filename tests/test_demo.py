"""`specroute demo` as a user runs it: a subprocess that prints a table, writes a PNG, and
leaves no process behind (also when interrupted with Ctrl-C)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from helpers import run_specroute

DEMO = [sys.executable, "-m", "controller.cli", "demo"]


def children_of(pid: int) -> list[int]:
    """PIDs whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_quick_demo_prints_its_table_and_writes_the_plot(tmp_path: Path) -> None:
    png = tmp_path / "demo.png"
    proc = await asyncio.create_subprocess_exec(
        *DEMO, "--quick", "--plot", str(png),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=tmp_path,
    )  # fmt: skip
    try:
        out_b, err_b = await asyncio.wait_for(proc.communicate(), 240)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    out, err = out_b.decode(), err_b.decode()
    assert proc.returncode == 0, out + err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("conc"))
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [r[0] for r in rows] == ["1", "10"]
    for r in rows:
        # conc, n, three decode estimates, three totals, "|", two percentages
        decode = [float(x.split("±")[0]) for x in r[3:6]]
        assert all(10 < d < 200 for d in decode), r
        assert r[-1].endswith("%") and r[-2].endswith("%")
        assert sum(float(p.rstrip("%")) for p in r[-2:]) == pytest.approx(100, abs=1)
    assert "time-scale" in out
    assert png.is_file() and png.stat().st_size > 1000
    assert f"plot written to {png}" in out


async def test_ctrl_c_leaves_no_process_behind() -> None:
    proc = await asyncio.create_subprocess_exec(
        *DEMO, "--quick", "--no-plot", "--levels", "1", "5", "10", "20",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        while True:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert line, "the demo ended before starting specroute"
            if line.startswith("specroute ("):
                break
        kids = children_of(proc.pid)
        assert len(kids) == 3  # two emulators and the proxy
        await asyncio.sleep(0.5)  # mid-sweep
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 130
        assert proc.stderr is not None
        err = (await proc.stderr.read()).decode()
        assert "Traceback" not in err and "interrupted" in err
        assert not [k for k in kids if alive(k)]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_bad_arguments_are_reported_without_starting_anything() -> None:
    code, _, err = await run_specroute("demo", "--profile", "no-such-profile", timeout_s=60)
    assert code == 2
    assert "no built-in profile 'no-such-profile'" in err and "Traceback" not in err
    cases = [
        (["--policy", "no-such-policy"], "unknown policy 'no-such-policy'"),
        (["--plot", "/no/such/dir/demo.png"], "/no/such/dir is not an existing directory"),
    ]
    for argv, needle in cases:
        code, out, err = await run_specroute("demo", *argv, timeout_s=60)
        assert code == 2 and needle in err and "Traceback" not in err, (argv, err)
        assert "emulated SGLang" not in out  # nothing started
    code, out, _ = await run_specroute("demo", "--help", timeout_s=60)
    assert code == 0 and "(default: 1 2 5 10 30 70)" in out  # the levels as a user types them
