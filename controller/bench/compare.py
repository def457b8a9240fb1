"""`specroute compare`: bench runs side by side per concurrency level.

Each cell is mean ± 95% half-width (n); for the second and later runs it adds the relative
difference against the first run and a verdict: faster / slower, or "not distinguishable"
when the two intervals overlap. For TTFT lower is better. Levels with fewer than
`MIN_REQUESTS` requests get a warning: too few to distinguish differences of a few percent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from controller.bench.result import BenchResult, LevelSummary
from policies.stats import Estimate, verdict

MIN_REQUESTS = 10


@dataclass(frozen=True)
class Metric:
    title: str
    get: Callable[[LevelSummary], Estimate | None]
    higher_is_better: bool
    digits: int


METRICS: tuple[Metric, ...] = (
    Metric("decode tok/s", lambda s: s.decode_tok_s, True, 2),
    Metric("TTFT s", lambda s: s.ttft_s, False, 4),
    Metric("total tok/s", lambda s: s.total_tok_s, True, 1),
)


def _cell(e: Estimate | None, digits: int) -> str:
    if e is None:
        return "-"
    ci = "?" if e.half_width is None else f"{e.half_width:.{digits}f}"
    return f"{e.mean:.{digits}f} ± {ci} (n={e.n})"


def _relative(base: Estimate | None, other: Estimate | None, higher_is_better: bool) -> str:
    if base is None or other is None:
        return ""
    rel = "" if base.mean == 0 else f"{(other.mean - base.mean) / base.mean * 100:+.1f}% "
    return rel + verdict(base, other, higher_is_better)


def compare_table(runs: Sequence[BenchResult], names: Sequence[str] | None = None) -> tuple[str, list[str]]:
    """The side-by-side table as text, and warnings about small samples."""
    if not runs:
        raise ValueError("nothing to compare")
    names = list(names or [r.label for r in runs])
    by_level = [{lv.concurrency: lv.summary for lv in r.levels} for r in runs]
    levels = sorted({c for m in by_level for c in m})
    header = ["conc", "metric", *(f"[{i + 1}] {n}" for i, n in enumerate(names))]
    rows: list[list[str]] = []
    warnings: list[str] = []
    for conc in levels:
        for metric in METRICS:
            base = by_level[0].get(conc)
            base_est = metric.get(base) if base else None
            row = [str(conc), metric.title]
            for i, m in enumerate(by_level):
                s = m.get(conc)
                est = metric.get(s) if s else None
                cell = _cell(est, metric.digits)
                if i > 0 and s is not None:
                    cell = f"{cell}  {_relative(base_est, est, metric.higher_is_better)}".rstrip()
                row.append(cell)
            rows.append(row)
        row = [str(conc), "errors"]
        for i, m in enumerate(by_level):
            s = m.get(conc)
            row.append("-" if s is None else f"{s.errors}/{s.n}")
            if s is not None and s.ok < MIN_REQUESTS:
                warnings.append(
                    f"[{i + 1}] {names[i]}, concurrency {conc}: only {s.ok} successful requests "
                    f"(< {MIN_REQUESTS}): too few to distinguish differences of a few percent"
                )
        rows.append(row)
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    prev = None
    for r in rows:
        shown = r if r[0] != prev else ["", *r[1:]]
        prev = r[0]
        lines.append("  ".join(c.ljust(w) for c, w in zip(shown, widths, strict=True)).rstrip())
    return "\n".join(lines), warnings


def describe_runs(runs: Sequence[BenchResult], names: Sequence[str]) -> list[str]:
    out = []
    for i, (r, n) in enumerate(zip(runs, names, strict=True)):
        md = r.metadata
        info = md.get("server_info") or {}
        accept = info.get("avg_spec_accept_length")
        extra = f", accept length {accept:.2f}" if isinstance(accept, int | float) else ""
        out.append(
            f"[{i + 1}] {n}: {md.get('url')} {md.get('endpoint')}, prompts {md.get('prompt_set')}, "
            f"max_tokens {md.get('max_tokens')}, started {md.get('started')}{extra}"
            + (" (interrupted)" if md.get("interrupted") else "")
        )
    return out


SETTINGS = ("endpoint", "prompt_set", "max_tokens", "temperature", "ignore_eos")


def setting_warnings(runs: Sequence[BenchResult], names: Sequence[str]) -> list[str]:
    """Warnings for settings that differ between runs (the comparison is then not like for like)."""
    out = []
    for key in SETTINGS:
        values = [r.metadata.get(key) for r in runs]
        if len({repr(v) for v in values}) > 1:
            shown = ", ".join(f"[{i + 1}] {v}" for i, v in enumerate(values))
            out.append(f"runs differ in {key} ({shown}): not a like-for-like comparison")
    return out
