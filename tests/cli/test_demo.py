"""`specroute demo` as a user runs it: a subprocess that prints a table, writes a PNG, and
leaves no process behind (also when interrupted with Ctrl-C)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from helpers import run_specroute

from controller.bench.result import LevelSummary
from controller.cli import demo
from policies.stats import Estimate

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
        *DEMO, "--quick", "--plot", str(png), "--progress",
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
    assert all(len(line) <= 100 for line in lines), [line for line in lines if len(line) > 100]
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("conc"))
    assert lines[header].split()[2:6] == ["baseline", "eagle", "specroute", "2x"]
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [r[0] for r in rows] == ["1", "10"]
    for r in rows:
        # conc, n, four decode estimates with their intervals, two totals, the verdict, eagle's share
        assert int(r[1]) >= 4
        decode = [x.split("±") for x in r[2:6]]
        assert all(10 < float(mean) < 200 and float(half) >= 0 for mean, half in decode), r
        assert all(float(t) > 0 for t in r[6:8]), r
        verdict = " ".join(r[8:-1])
        assert verdict in ("faster", "slower", "not distinguishable"), r
        assert r[-1].endswith("%") and 0 <= float(r[-1].rstrip("%")) <= 100
    assert "time-scale" in out and "`specroute compare`" in out
    # the four ways ran with a progress line each (stderr, as on a terminal)
    for way in ("baseline", "eagle", "specroute", "2x baseline"):
        assert f"{way}: concurrency 10" in err, err[-2000:]
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
        assert len(kids) == 5  # three emulators, specroute and the 2x baseline router
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


def _summary(decode: tuple[float, float], total: float, n: int = 30) -> LevelSummary:
    return LevelSummary(
        concurrency=10, n=n, errors=0, decode_tok_s=Estimate(n, *decode), ttft_s=None, e2e_s=None,
        total_tok_s=Estimate(n, total, total / 50), wall_s=10.0,
    )  # fmt: skip


def test_table_verdict_is_compares_and_plot_shows_the_four_ways() -> None:
    """The verdict column is `specroute compare`'s (policies.stats.verdict) on per-request decode
    tok/s, specroute against 2x baseline; the plot has the four ways and says 'emulated'."""
    pytest.importorskip("matplotlib")
    cases = [((50.0, 1.0), (40.0, 1.0), "faster"), ((40.0, 1.0), (50.0, 1.0), "slower"),
             ((45.0, 3.0), (46.0, 3.0), "not distinguishable")]  # fmt: skip
    rows = []
    for specroute, two_plain, expected in cases:
        s = {"baseline": _summary((40.0, 1.0), 400), "eagle": _summary((30.0, 1.0), 300)}
        s |= {"specroute": _summary(specroute, 500), "2x baseline": _summary(two_plain, 450)}
        row = demo.Row(10, s, {"baseline": 3, "eagle": 1})
        assert demo.specroute_verdict(row) == expected
        line = demo.format_row(row, 1.0)
        assert expected in line and line.endswith("25%") and len(line) <= 100
        rows.append(row)
    args = argparse.Namespace(profile="kimi-k25-int4-8gpu", policy="cost_model", time_scale=0.5)
    fig = demo.plot_figure(rows[:1], 0.5, demo.plot_title(args))
    try:
        assert "emulated SGLang servers" in fig._suptitle.get_text()
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert labels == ["baseline", "eagle", "specroute", "2x baseline"]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
