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
    assert "answers of 64 tokens" in out
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("conc"))
    assert lines[header].split() == [
        "conc",
        "way",
        "n",
        "decode",
        "tok/s",
        "TTFT",
        "s",
        "e2e",
        "s",
        "total",
        "tok/s",
    ]
    blocks = [i for i, line in enumerate(lines) if i > header and line[:4].strip().isdigit()]
    assert [lines[i].split()[0] for i in blocks] == ["1", "10"]
    for b in blocks:
        ways = [lines[b].split()[1:], *(ln.split() for ln in lines[b + 1 : b + 4])]
        assert [w[0] for w in ways] == ["baseline", "eagle", "specroute", "2x"]  # every way, full names
        for w in ways:
            cells = w[2:] if w[0] == "2x" else w[1:]
            n, decode, ttft, e2e, total = int(cells[0]), *cells[1:4], float(cells[4])
            assert n >= 4 and total > 0, w  # all four rows have their total tok/s
            for est in (decode, ttft, e2e):
                mean, half = (float(x) for x in est.split("±"))
                assert mean > 0 and half >= 0, w
        block = " ".join(ln.strip() for ln in lines[b + 4 : b + 9])
        assert "verdict: specroute vs 2x baseline, end-to-end: " in block and "n=" in block
        assert any(v in block for v in ("faster (", "slower (", "not distinguishable ("))
        assert "why: chose eagle " in block and "the EAGLE-3 server alone" in block and "TTFT" in block
    assert "When specroute helps" in out and "This compares specroute" in out
    assert "time-scale" in out and "`specroute compare`" in out
    # the four ways ran with progress (stderr is a pipe here: lines, not a bar)
    for way in ("baseline", "eagle", "specroute", "2x baseline"):
        assert f"bench {way}: level 1/1 concurrency 10 " in err, err[-2000:]
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


def _summary(decode: tuple[float, float], total: float, n: int = 30, e2e: tuple[float, float] = (2.0, 0.1),
             ttft: tuple[float, float] = (0.2, 0.01)) -> LevelSummary:  # fmt: skip
    return LevelSummary(
        concurrency=10, n=n, errors=0, decode_tok_s=Estimate(n, *decode), ttft_s=Estimate(n, *ttft),
        e2e_s=Estimate(n, *e2e), total_tok_s=Estimate(n, total, total / 50), wall_s=10.0,
    )  # fmt: skip


def test_table_verdicts_are_compares_on_e2e_and_say_why_eagle_was_chosen() -> None:
    """The verdict is `specroute compare`'s (policies.stats.verdict) on end-to-end time, specroute
    against 2x baseline, with the requests behind it; the line under it explains eagle's share."""
    cases = [((2.0, 0.05), (2.5, 0.05), "faster"), ((2.5, 0.05), (2.0, 0.05), "slower"),
             ((2.0, 0.2), (2.1, 0.2), "not distinguishable")]  # fmt: skip
    rows = []
    for specroute, two_plain, expected in cases:
        # eagle decodes faster, but its TTFT is 300 ms higher: it answers later
        s = {"baseline": _summary((90.0, 1.0), 90, e2e=(1.6, 0.02), ttft=(0.2, 0.01)),
             "eagle": _summary((95.0, 1.0), 95, e2e=(1.9, 0.02), ttft=(0.5, 0.01))}  # fmt: skip
        s |= {
            "specroute": _summary((90.0, 1.0), 500, e2e=specroute),
            "2x baseline": _summary((90.0, 1.0), 450, e2e=two_plain),
        }
        row = demo.Row(10, s, {"baseline": 3, "eagle": 1})
        assert demo.specroute_verdict(row) == expected
        text = demo.format_row(row, 1.0, 128)
        lines = text.splitlines()
        assert all(len(line) <= 100 for line in lines)
        assert [ln.split()[1 if i == 0 else 0] for i, ln in enumerate(lines[:4])] == [
            "baseline", "eagle", "specroute", "2x"]  # fmt: skip
        assert f"specroute vs 2x baseline, end-to-end: {expected} (" in text and "n=30 and 30" in text
        why = " ".join(ln.strip() for ln in lines[4:])
        assert "why: chose eagle 25%" in why and "answers later than the plain one" in why
        assert "TTFT +300 ms" in why and "TTFT decides on 128-token answers" in why
        rows.append(row)
    sentence = demo.summary_sentence(rows, demo.eagle_lead(demo.resolve_profile("kimi-k25-int4-8gpu")))
    assert "faster at 1 (10) of 3" in sentence and "slower at 1 (10)" in sentence
    assert "lone stream +3.7% faster" in sentence and "docs/when-specroute-helps.md" in sentence


def test_why_line_calls_eagle_decode_slower_only_when_compare_would() -> None:
    """A decode difference inside the intervals (the demo at concurrency 1: 92.0 ± 5.0 against
    92.6 ± 0.0 tok/s) is "no faster", not "slower"; a clear one is "slower"."""
    for eagle_decode, expected, absent in (
        ((92.0, 5.0), "its per-request decode is no faster", "decode is slower"),
        ((70.0, 1.0), "its per-request decode is slower", "no faster"),
    ):
        s = {"baseline": _summary((92.6, 0.1), 90, e2e=(1.6, 0.02), ttft=(0.21, 0.01)),
             "eagle": _summary(eagle_decode, 88, e2e=(1.7, 0.02), ttft=(0.23, 0.01))}  # fmt: skip
        s |= {"specroute": _summary((92.0, 1.0), 90, e2e=(1.6, 0.02)),
              "2x baseline": _summary((92.0, 1.0), 90, e2e=(1.6, 0.02))}  # fmt: skip
        text = demo.format_row(demo.Row(1, s, {"baseline": 8}), 1.0, 128)
        why = " ".join(ln.strip() for ln in text.splitlines())
        assert expected in why and absent not in why, why


def test_plot_has_the_tables_columns_for_the_four_ways() -> None:
    pytest.importorskip("matplotlib")
    s = {w: _summary((90.0, 1.0), 100) for w in demo.WAYS}
    rows = [demo.Row(1, s, {"baseline": 1}), demo.Row(10, s, {"eagle": 1})]
    args = argparse.Namespace(profile="kimi-k25-int4-8gpu", policy="cost_model", time_scale=0.5)
    fig = demo.plot_figure(rows, 0.5, demo.plot_title(args))
    try:
        assert "emulated SGLang servers" in fig._suptitle.get_text()
        assert [ax.get_title() for ax in fig.axes] == [label for _, label in demo.PANELS]
        assert [attr for attr, _ in demo.PANELS] == ["decode_tok_s", "ttft_s", "e2e_s", "total_tok_s"]
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert labels == ["baseline", "eagle", "specroute", "2x baseline"]
        for ax in fig.axes:  # a point per table row: four ways x two levels
            assert [len(c.lines[0].get_xdata()) for c in ax.containers] == [2, 2, 2, 2]
        # time scale 0.5: e2e 2.0 wall seconds are 4.0 profile seconds, as in the table
        e2e_axis = fig.axes[2]
        assert max(max(c.lines[0].get_ydata()) for c in e2e_axis.containers) == 4.0
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
