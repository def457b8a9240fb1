"""What `specroute demo` prints and plots: per profile a table, a verdict and a why line per
level, and a summary that says where the pair paid.

Every judgement is one rule (`judge`): the Welch 95% interval of the difference between two
ways' means (end-to-end time, or decode rate), relative to the reference way's mean, judged by
the planner's tie rule (`policies.stats.tie_rule`): a tie when the interval contains zero or the
difference is within `TIE_WITHIN` of the reference, "too few requests" without an interval,
else faster or slower. The why line and the summary read the same judgements (`eagle_judgement`,
`pair_judgement`), so they cannot disagree.

The three ways run on the same hardware, two servers each: specroute over one plain and one
EAGLE-3 server, and a least-loaded router over two plain ("2x baseline") or two EAGLE-3 servers
("2x EAGLE-3"). The why line compares the last two: EAGLE-3 against plain at that load, which is
what specroute's share of requests sent to EAGLE-3 answers to.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from controller.bench.result import LevelResult, LevelSummary
from policies.base import Pool
from policies.stats import Estimate, estimate, t_quantile, tie_rule, welch_difference

WAYS = ("specroute", "2x baseline", "2x EAGLE-3")
PAIR, TWO_PLAIN, TWO_EAGLE = WAYS
TIE_WITHIN = 0.01
"""Differences under 1% of the reference are ties, as in `specroute plan`."""
WIDTH = 100
README_SECTION = '"When specroute helps" (docs/when-specroute-helps.md)'

Verdict = Literal["faster", "slower", "tie", "too few requests"]


@dataclass(frozen=True)
class Judgement:
    """`other` against `base` on one figure: the verdict and the relative difference with its
    95% interval (fractions of `base`'s mean)."""

    verdict: Verdict
    rel: float
    low: float
    high: float

    def interval_text(self) -> str:
        if math.isnan(self.low):
            return f"{self.rel:+.1%}"
        return f"{self.rel:+.1%} [{100 * self.low:+.1f}, {100 * self.high:+.1f}]"


def judge(base: Estimate | None, other: Estimate | None, higher_is_better: bool) -> Judgement | None:
    """`other` against `base` (see the module note); None when either is missing."""
    if base is None or other is None or base.mean == 0:
        return None
    diff = welch_difference(base, other)
    rule = tie_rule(diff, base.mean, TIE_WITHIN, max(abs(base.mean), abs(other.mean)))
    verdict: Verdict
    if rule == "n/a":
        verdict = "too few requests"
    elif rule == "tie":
        verdict = "tie"
    else:
        better = diff.mean > 0 if higher_is_better else diff.mean < 0
        verdict = "faster" if better else "slower"
    scale = abs(base.mean)
    return Judgement(verdict, diff.mean / scale, diff.low / scale, diff.high / scale)


@dataclass
class Row:
    """One concurrency level of one profile: each way's summary and specroute's choices."""

    concurrency: int
    summaries: dict[str, LevelSummary] = field(default_factory=dict)
    chosen: dict[Pool, int] = field(default_factory=dict)
    eagle_cap: int | None = None
    """The EAGLE-3 server's max_running_requests (from the profile), for the why line."""
    eagle_by_domain: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per prompt domain, (requests specroute's EAGLE-3 server answered, requests) among the
    measured ones (the content act)."""
    domain_e2e: dict[str, dict[str, Estimate]] = field(default_factory=dict)
    """Per way, each prompt domain's end-to-end time (the content act)."""


@dataclass
class ActResult:
    """The rows measured on one profile."""

    profile: str
    title: str
    rows: list[Row] = field(default_factory=list)
    content: bool = False
    """The content act: 50/50 code and prose, EAGLE-3's acceptance by prompt."""


def stratified(groups: Sequence[Sequence[float]]) -> Estimate | None:
    """The mean of traffic made of equal shares of `groups` (e.g. code and prose): the mean of the
    groups' means, its standard error from each group's own spread (a stratified estimate: the
    shares are fixed by design, so how the groups differ is not noise). `std` is set so that
    `std**2 / n` is that squared standard error, as `welch_difference` reads it. None when a
    group has fewer than two values."""
    parts = [estimate(g) for g in groups]
    if not parts or any(e is None or e.std is None for e in parts):
        return None
    k, n = len(parts), sum(e.n for e in parts if e is not None)
    mean = math.fsum(e.mean for e in parts if e is not None) / k
    se2 = math.fsum(e.std**2 / e.n for e in parts if e is not None and e.std is not None) / k**2
    return Estimate(n, mean, t_quantile(0.95, n - k) * math.sqrt(se2), math.sqrt(se2 * n))


def _by_category(level: LevelResult) -> dict[str, list[Any]]:
    by: dict[str, list[Any]] = {}
    for r in level.requests:
        if r.phase == "measured" and r.ok and r.category is not None:
            by.setdefault(r.category, []).append(r)
    return by


def domain_estimates(level: LevelResult, attr: str) -> dict[str, Estimate]:
    """Per category, `attr` (e2e_s, ttft_s, decode_tok_s) of the answered measured requests."""
    out = {}
    for category, rs in sorted(_by_category(level).items()):
        e = estimate([v for r in rs if (v := getattr(r, attr)) is not None])
        if e is not None:
            out[category] = e
    return out


def stratified_summary(level: LevelResult) -> LevelSummary:
    """`level.summary` with decode tok/s, TTFT and end-to-end time as stratified estimates over
    the measured requests' categories (equal shares; see `stratified`); as it was when a
    category has fewer than two answered requests."""
    by = _by_category(level)
    if len(by) < 2:
        return level.summary

    def strata(attr: str) -> Estimate | None:
        groups = [[v for r in rs if (v := getattr(r, attr)) is not None] for rs in by.values()]
        return stratified(groups) or getattr(level.summary, attr)

    return replace(
        level.summary, decode_tok_s=strata("decode_tok_s"), ttft_s=strata("ttft_s"), e2e_s=strata("e2e_s")
    )


def _e2e(s: LevelSummary | None) -> Estimate | None:
    return s.e2e_s if s is not None else None


def pair_judgement(row: Row, against: str) -> Judgement | None:
    """specroute against `against` (2x baseline or 2x EAGLE-3) on end-to-end time."""
    return judge(_e2e(row.summaries.get(against)), _e2e(row.summaries.get(PAIR)), False)


def eagle_judgement(row: Row) -> Judgement | None:
    """EAGLE-3 against plain on end-to-end time: 2x EAGLE-3 against 2x baseline."""
    return judge(_e2e(row.summaries.get(TWO_PLAIN)), _e2e(row.summaries.get(TWO_EAGLE)), False)


def eagle_decode_judgement(row: Row) -> Judgement | None:
    plain, eagle = row.summaries.get(TWO_PLAIN), row.summaries.get(TWO_EAGLE)
    return judge(plain.decode_tok_s if plain else None, eagle.decode_tok_s if eagle else None, True)


# --- the table ------------------------------------------------------------------------------

_COLUMNS = (("way", 12), ("n", 4), ("decode tok/s", 14), ("TTFT s", 14), ("e2e s", 14), ("total tok/s", 14))


def header(scale: float, max_tokens: int) -> str:
    """What the tables hold, and their column titles (at most WIDTH columns)."""
    lines = []
    if scale != 1.0:
        lines.append(f"emulators at --time-scale {scale}: tok/s and seconds are rescaled to profile time")
    lines.append(
        f"answers of {max_tokens} tokens; per way: n measured requests, per-request decode tok/s, time to "
        "first token,"
    )
    lines.append("end-to-end time (mean±95% CI) and total tok/s of all its requests")
    return "\n".join(lines)


def column_titles() -> str:
    return f"{'conc':>4}  " + "".join(f"{t:<{w}}" if t == "way" else f"{t:>{w}}" for t, w in _COLUMNS)


def _fmt_est(s: LevelSummary | None, attr: str, scale: float, ci: bool, digits: int = 1) -> str:
    """`mean±half` (or the mean alone) in profile time: tok/s times the time scale, seconds divided."""
    est = getattr(s, attr, None) if s is not None else None
    if est is None:
        return "-"
    f = scale if attr.endswith("tok_s") else 1.0 / scale
    if ci and est.half_width is not None:
        return f"{est.mean * f:.{digits}f}±{est.half_width * f:.{digits}f}"
    return f"{est.mean * f:.{digits if ci else 0}f}"


_AGAINST = {"faster": "faster than", "slower": "slower than", "tie": "a tie with"}


def _against(j: Judgement | None, way: str) -> str:
    if j is None:
        return f"not compared with {way} (no figures)"
    if j.verdict == "too few requests":
        return f"not judged against {way}: too few requests ({j.interval_text()})"
    return f"{_AGAINST[j.verdict]} {way} ({j.interval_text()})"


def verdict_line(row: Row) -> str:
    """specroute against both alternatives on end-to-end time, with the requests behind it."""
    ns = [str(s.ok) if (s := row.summaries.get(w)) is not None else "0" for w in WAYS]
    return (
        f"end-to-end, specroute is {_against(pair_judgement(row, TWO_PLAIN), TWO_PLAIN)} and "
        f"{_against(pair_judgement(row, TWO_EAGLE), TWO_EAGLE)}; n={'/'.join(ns)}"
    )


_EAGLE_SAYS = {
    "faster": "EAGLE-3 answers sooner than plain",
    "slower": "EAGLE-3 answers later than plain",
    "tie": "EAGLE-3 and plain are a tie",
    "too few requests": "too few requests to compare EAGLE-3 with plain",
}
"""The why line's words for `eagle_judgement`; the summary uses `_EAGLE_SUMMARY`'s."""


def _load(c: int) -> str:
    return f"at {c} in flight" + (f" ({c / 2:g} per server)" if c > 1 else "")


def why_line(row: Row, max_tokens: int, scale: float = 1.0) -> str:
    """Why specroute sent the share it did to EAGLE-3: EAGLE-3 against plain at this load (two
    servers each), on end-to-end time and what makes it up."""
    total = sum(row.chosen.values())
    share = f"chose eagle {100 * row.chosen.get('eagle', 0) / total:.0f}%" if total else "chose eagle -"
    if row.eagle_by_domain:
        share += (
            " ("
            + ", ".join(f"{d} {100 * e / n:.0f}%" for d, (e, n) in sorted(row.eagle_by_domain.items()))
            + ")"
        )
    e2e = eagle_judgement(row)
    plain, eagle = row.summaries.get(TWO_PLAIN), row.summaries.get(TWO_EAGLE)
    if e2e is None or plain is None or eagle is None:
        return share
    by_plain, by_eagle = row.domain_e2e.get(TWO_PLAIN, {}), row.domain_e2e.get(TWO_EAGLE, {})
    if by_plain and by_eagle:
        said = []
        for domain in sorted(set(by_plain) & set(by_eagle)):
            j = judge(by_plain[domain], by_eagle[domain], False)
            if j is not None:
                said.append(f"on {domain} {_EAGLE_SAYS[j.verdict]} (e2e {j.interval_text()})")
        return (
            f"{share}: {_load(row.concurrency)}, 2x EAGLE-3 against 2x baseline: {'; '.join(said)}; "
            f"on the 50/50 mix {_EAGLE_SAYS[e2e.verdict]} ({e2e.interval_text()})"
        )
    decode = eagle_decode_judgement(row)
    ttft = "?"
    if plain.ttft_s is not None and eagle.ttft_s is not None:
        ttft = f"{(eagle.ttft_s.mean - plain.ttft_s.mean) / scale * 1000:+.0f} ms"
    out = (
        f"{share}: {_load(row.concurrency)} {_EAGLE_SAYS[e2e.verdict]} (2x EAGLE-3 against 2x baseline, "
        f"e2e {e2e.interval_text()}): decode {decode.interval_text() if decode else '?'}, TTFT {ttft}"
    )
    if plain.ttft_s is not None and eagle.ttft_s is not None and eagle.ttft_s.mean > 5 * plain.ttft_s.mean:
        cap = f" (each runs at most {row.eagle_cap} at once)" if row.eagle_cap else ""
        out += f"; requests wait in the EAGLE-3 servers' queues{cap}"
    d = decode.verdict if decode is not None else None
    if e2e.verdict != "faster" and d == "faster":
        out += f"; TTFT decides on {max_tokens}-token answers, not decode"
    elif e2e.verdict != "faster" and d == "slower":
        out += "; its per-request decode is slower at this batch size"
    elif e2e.verdict != "faster" and d == "tie":
        out += "; its per-request decode is no faster at this batch size"
    return out


def _wrap(text: str, indent: int = 6) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=" " * indent, subsequent_indent=" " * (indent + 2))


def format_row(row: Row, scale: float, max_tokens: int) -> str:
    """One level: a line per way, then the verdict and why eagle was (not) chosen."""
    lines = []
    for i, way in enumerate(WAYS):
        s = row.summaries.get(way)
        cells = [
            way,
            str(s.ok if s is not None else 0),
            _fmt_est(s, "decode_tok_s", scale, True),
            _fmt_est(s, "ttft_s", scale, True, 3),
            _fmt_est(s, "e2e_s", scale, True, 3 if (s and s.e2e_s and s.e2e_s.mean / scale < 10) else 2),
            _fmt_est(s, "total_tok_s", scale, False),
        ]
        conc = f"{row.concurrency:>4}" if i == 0 else " " * 4
        body = "".join(
            f"{c:<{w}}" if t == "way" else f"{c:>{w}}" for c, (t, w) in zip(cells, _COLUMNS, strict=True)
        )
        lines.append(f"{conc}  {body}".rstrip())
    lines += _wrap("verdict: " + verdict_line(row))
    lines += _wrap("why: " + why_line(row, max_tokens, scale))
    return "\n".join(lines)


# --- the summary ----------------------------------------------------------------------------


Judge = Callable[[Row], Judgement | None]


def _levels(rows: Sequence[Row], judgement: Judge, verdict: Verdict) -> list[int]:
    return [r.concurrency for r in rows if (j := judgement(r)) is not None and j.verdict == verdict]


def _and(levels: Sequence[int]) -> str:
    """`1`, `1 and 16`, `1, 8 and 32`."""
    text = [str(c) for c in levels]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} and {text[-1]}"


def _count(rows: Sequence[Row], judgement: Judge, words: dict[Verdict, str]) -> str:
    """`WORD at LEVELS` for each verdict that occurred, in `words`' order."""
    parts = []
    for verdict, word in words.items():
        levels = _levels(rows, judgement, verdict)
        if levels:
            parts.append(f"{word} at {_and(levels)}")
    return "; ".join(parts) if parts else "not judged"


_PAIR_SUMMARY: dict[Verdict, str] = {
    "faster": "faster",
    "tie": "a tie",
    "slower": "slower",
    "too few requests": "not judged (too few requests)",
}
_EAGLE_SUMMARY: dict[Verdict, str] = {
    "faster": "answered sooner than plain",
    "tie": "was a tie with plain",
    "slower": "answered later than plain",
    "too few requests": "was not judged against plain (too few requests)",
}
"""The summary's words for `eagle_judgement`, in step with the why line's `_EAGLE_SAYS`."""


def act_summary(act: ActResult) -> str:
    """What one profile's table shows, level by level, and what follows from it."""
    rows = act.rows

    def vs_plain(r: Row) -> Judgement | None:
        return pair_judgement(r, TWO_PLAIN)

    def vs_eagle(r: Row) -> Judgement | None:
        return pair_judgement(r, TWO_EAGLE)

    out = (
        f"On {act.profile} (concurrency {_and([r.concurrency for r in rows])}), specroute against 2x "
        f"baseline was {_count(rows, vs_plain, _PAIR_SUMMARY)}; against 2x EAGLE-3 "
        f"{_count(rows, vs_eagle, _PAIR_SUMMARY)}. EAGLE-3 {_count(rows, eagle_judgement, _EAGLE_SUMMARY)}."
    )
    if act.content:
        return out + _content_summary(rows, vs_plain, vs_eagle)
    wins = _levels(rows, vs_plain, "faster")
    losses = _levels(rows, vs_plain, "slower")
    sooner = _levels(rows, eagle_judgement, "faster")
    if wins:
        out += f" The pair paid against two plain servers at {_and(wins)} in flight"
        out += f", not at {_and(losses)}." if losses else "."
    elif losses:
        out += f" Two plain servers served better than the pair at {_and(losses)} in flight."
    if rows and len(sooner) == len(rows):
        beaten = _levels(rows, vs_eagle, "slower")
        out += " EAGLE-3 led plain at every level measured, so two EAGLE-3 servers are the deployment to beat"
        out += f" (they were faster than the pair at {_and(beaten)})." if beaten else "."
    elif rows and not sooner:
        out += " EAGLE-3 led plain at no level measured: a pair has nothing to gain from it here."
    return out


def _content_summary(rows: Sequence[Row], vs_plain: Judge, vs_eagle: Judge) -> str:
    """Where routing by content beat both alternatives (the content act)."""
    both = [c for c in _levels(rows, vs_plain, "faster") if c in _levels(rows, vs_eagle, "faster")]
    lost = sorted(set(_levels(rows, vs_plain, "slower")) | set(_levels(rows, vs_eagle, "slower")))
    if both:
        out = (
            f" On 50/50 code and prose the pair beat both alternatives at {_and(both)} in flight, sending "
            "code to EAGLE-3 and prose to the plain server as it learned from the warm-up"
        )
        rest = [r.concurrency for r in rows if r.concurrency not in both]
        out += f"; not resolved as a win over both at {_and(rest)}." if rest else "."
    else:
        out = " On 50/50 code and prose the pair beat both alternatives at no level measured."
    if lost:
        out += f" An alternative was faster than the pair at {_and(lost)}."
    return out


def closing(acts: Sequence[ActResult]) -> str:
    """The summary under the tables: each profile's, then where a pair pays."""
    parts = [act_summary(a) for a in acts]
    tail = (
        "A pair pays where EAGLE-3 answers much sooner than plain at light load and the plain server's "
        "throughput is needed under heavy load"
    )
    if any(a.content for a in acts):
        tail += ", and where EAGLE-3 speeds up some prompts and slows others, which specroute learns"
    parts.append(
        f"{tail}; {README_SECTION} shows simulated crossovers, and `specroute plan` checks your own servers."
    )
    return "\n".join(parts)


def wrap_paragraphs(text: str) -> list[str]:
    out: list[str] = []
    for para in text.split("\n"):
        out += textwrap.wrap(para, WIDTH)
    return out


# --- the plot -------------------------------------------------------------------------------

PANELS = (
    ("decode_tok_s", "per-request decode tok/s"),
    ("ttft_s", "TTFT s"),
    ("e2e_s", "end-to-end s"),
    ("total_tok_s", "total tok/s"),
)
"""The table's columns, a panel each, in its order."""


def plot_figure(acts: Sequence[ActResult], scale: float, title: str) -> Any:
    """The figure: a row of panels per profile, the table's columns (decode, TTFT, e2e, total
    tok/s) of every way, a point per table row, with 95% intervals; in profile time as the table."""
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(len(acts), len(PANELS), figsize=(15, 3.9 * len(acts) + 0.6), squeeze=False)
    for act, axes in zip(acts, grid, strict=True):
        xs = [r.concurrency for r in act.rows]
        for ax, (attr, label) in zip(axes, PANELS, strict=True):
            f = scale if attr.endswith("tok_s") else 1.0 / scale
            for way in WAYS:
                ys, errs = [], []
                for r in act.rows:
                    est = getattr(r.summaries.get(way), attr, None)
                    ys.append(est.mean * f if est is not None else float("nan"))
                    half = est.half_width if est is not None else None
                    errs.append(half * f if half is not None else 0.0)
                style = "-" if way == PAIR else "--"
                ax.errorbar(xs, ys, yerr=errs, marker="o", linestyle=style, capsize=3, label=way)
            ax.set_xscale("log")
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.tick_params(axis="x", which="minor", labelbottom=False)  # the levels label the axis
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label + " (95% CI)", fontsize=8)
            ax.set_title(f"{act.profile}: {label}", fontsize=8)
            ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
