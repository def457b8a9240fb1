"""`specroute compare`: bench runs side by side per concurrency level.

Each cell is mean ± 95% half-width (n); for the second and later runs it adds the relative
difference against the first run and a verdict: faster / slower, or "not distinguishable"
when the two intervals overlap. For TTFT and e2e lower is better. Levels with fewer than
`MIN_REQUESTS` requests get a warning: too few to distinguish differences of a few percent.

Runs measured with different settings (`SETTINGS`: max_tokens, prompts, endpoint, ...) are not
like for like -- an answer twice as long takes twice as long -- so `setting_warnings` names them
and every verdict of such a run says so.

Each level ends with a `verdict` row, and the verdict is the end-to-end time's (what a user
waits for), not the decode rate's: decode is measured from the first token on, so a server
whose requests wait in its queue can decode faster and still answer later. When the two
disagree the row says so. A level where requests queued (`queued_levels`: the server reported
a queue during it, or, without queue metrics, its p50 TTFT is over `QUEUE_TTFT_FACTOR` times
the lowest level's) is
flagged "queued: decode rate is not the user's experience", in this table and in `bench`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from controller.bench.result import BenchResult, LevelSummary
from policies.stats import Estimate, verdict

MIN_REQUESTS = 10
QUEUE_TTFT_FACTOR = 10.0
"""Without the server's queue metrics, a level whose p50 TTFT is above this many times the
lowest level's is taken as queued (prefill batching alone makes TTFT grow: 6x from 1 to 250
clients on the built-in Kimi profile, with no queue)."""
QUEUED_NOTE = "queued: decode rate is not the user's experience"


@dataclass(frozen=True)
class Metric:
    title: str
    get: Callable[[LevelSummary], Estimate | None]
    higher_is_better: bool
    digits: int


METRICS: tuple[Metric, ...] = (
    Metric("decode tok/s", lambda s: s.decode_tok_s, True, 2),
    Metric("TTFT s", lambda s: s.ttft_s, False, 4),
    Metric("e2e s", lambda s: s.e2e_s, False, 3),
    Metric("total tok/s", lambda s: s.total_tok_s, True, 1),
)
E2E = METRICS[2]
DECODE = METRICS[0]


def queued_levels(run: BenchResult) -> dict[int, str]:
    """{concurrency: evidence} of the levels whose requests queued: the server reported a queue
    during the level (`metadata["backend_queue_max"]`), or -- when it reported none for the level,
    its metrics lacking the queue -- the level's p50 TTFT is more than `QUEUE_TTFT_FACTOR` times
    that of the run's lowest level."""
    queues = run.metadata.get("backend_queue_max") or {}
    levels = sorted(run.levels, key=lambda lv: lv.concurrency)
    ref = next((lv.summary for lv in levels if lv.summary.ttft_s and lv.summary.ttft_s.p50), None)
    out: dict[int, str] = {}
    for lv in levels:
        c, why = lv.concurrency, []
        queued = queues.get(str(c))
        if isinstance(queued, int | float) and queued > 0:
            why.append(f"server queue up to {queued:g}")
        ttft = lv.summary.ttft_s
        if queued is not None:
            pass  # the server's own queue figure says it; TTFT growth alone is prefill batching
        elif ref is not None and ref.ttft_s is not None and ref.ttft_s.p50 and ttft is not None and ttft.p50:
            ratio = ttft.p50 / ref.ttft_s.p50
            if c != ref.concurrency and ratio > QUEUE_TTFT_FACTOR:
                why.append(f"p50 TTFT {ttft.p50:.3g} s, {ratio:.0f}x concurrency {ref.concurrency}'s")
        if why:
            out[c] = ", ".join(why)
    return out


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
    queued = [queued_levels(r) for r in runs]
    unlike = mismatched_settings(runs)
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
        rows.append([str(conc), "verdict", *_verdicts(by_level, queued, conc, unlike)])
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    prev = None
    for r in rows:
        shown = r if r[0] != prev else ["", *r[1:]]
        prev = r[0]
        lines.append("  ".join(c.ljust(w) for c, w in zip(shown, widths, strict=True)).rstrip())
    return "\n".join(lines), warnings


def _verdicts(
    by_level: Sequence[dict[int, LevelSummary]],
    queued: Sequence[dict[int, str]],
    conc: int,
    unlike: Sequence[str] = (),
) -> list[str]:
    """Per run: the e2e verdict against run [1] (with the decode verdict when it disagrees), the
    settings that differ from [1]'s (`unlike`) and the queued flag."""
    base = by_level[0].get(conc)
    out = []
    for i, m in enumerate(by_level):
        s = m.get(conc)
        parts = []
        if i > 0 and s is not None and base is not None:
            e2e = verdict(E2E.get(base), E2E.get(s), False)
            decode = verdict(DECODE.get(base), DECODE.get(s), True)
            parts.append(f"e2e {_relative(E2E.get(base), E2E.get(s), False)}")
            if decode != e2e:
                parts.append(f"(decode alone would say {decode})")
            if unlike:
                parts.append(f"(not like for like: {', '.join(unlike)} differ{'s' * (len(unlike) == 1)})")
        if s is not None and conc in queued[i]:
            parts.append(f"{QUEUED_NOTE} ({queued[i][conc]})")
        out.append(" ".join(parts) if parts else "-")
    return out


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


SETTINGS = ("endpoint", "prompt_set", "max_tokens", "temperature", "ignore_eos", "model", "warmup")
"""What a run was measured with that changes its figures; runs compared should agree on them."""


def mismatched_settings(runs: Sequence[BenchResult]) -> list[str]:
    """The `SETTINGS` whose values differ between the runs (in `SETTINGS` order)."""
    return [key for key in SETTINGS if len({repr(r.metadata.get(key)) for r in runs}) > 1]


def setting_warnings(runs: Sequence[BenchResult], names: Sequence[str]) -> list[str]:
    """Warnings for settings that differ between runs (the comparison is then not like for like)."""
    out = []
    for key in mismatched_settings(runs):
        shown = ", ".join(f"[{i + 1}] {r.metadata.get(key)}" for i, r in enumerate(runs))
        out.append(f"runs differ in {key} ({shown}): not a like-for-like comparison")
    return out
