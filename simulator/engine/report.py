"""Tables and the `--report DIR` output (markdown + PNG plots) of simulated runs.

matplotlib is an optional extra (`pip install 'specroute[plot]'`): it is imported only when a
report is written, and its absence is a clear error, not a traceback.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simulator.engine.results import RunResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class ReportError(RuntimeError):
    """The report cannot be written (matplotlib missing, directory not writable)."""


def align_columns(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, left: Container[int], strip: bool = False
) -> str:
    """A plain-text table: columns two spaces apart, those in `left` left-aligned, the others
    right-aligned; `strip` drops each line's trailing blanks."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        line = "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        lines.append(line.rstrip() if strip else line)
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a markdown table."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def report_directory(directory: str | Path) -> Path:
    """Load matplotlib (Agg backend) and create `directory`; ReportError when either fails."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # an unusable pyplot fails here, not in the caller
    except ImportError:
        raise ReportError(
            "--report needs matplotlib, an optional extra: pip install 'specroute[plot]'"
        ) from None
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"{d}: cannot create report directory: {e.strerror or e}") from None
    return d


def save_figure(fig: Figure, path: Path) -> None:
    """Save `fig` as a PNG at `path` and close it."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise ReportError(f"{path}: cannot write plot: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def write_markdown(path: Path, lines: Sequence[str]) -> Path:
    """Write the lines (joined with newlines) to `path`."""
    try:
        path.write_text("\n".join(lines), encoding="utf-8")
    except OSError as e:
        raise ReportError(f"{path}: cannot write report: {e.strerror or e}") from None
    return path


def run_label(run: RunResult) -> str:
    dep = ",".join(f"{k}={v}" for k, v in run.deployment.items())
    params = ",".join(f"{k}={v}" for k, v in run.params.items())
    name = f"{run.policy}:{params}" if params else run.policy
    return f"{name} [{dep}]"


_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("requests", "n", "{:d}"),
    ("mean_ttft_s", "TTFT mean s", "{:.3f}"),
    ("p99_ttft_s", "TTFT p99 s", "{:.3f}"),
    ("mean_e2e_s", "e2e mean s", "{:.2f}"),
    ("p50_e2e_s", "e2e p50 s", "{:.2f}"),
    ("p99_e2e_s", "e2e p99 s", "{:.2f}"),
    ("mean_decode_tok_s", "decode tok/s", "{:.1f}"),
    ("throughput_tok_s", "total tok/s", "{:.1f}"),
)


def _cell(summary: dict[str, Any], key: str, fmt: str) -> str:
    v = summary.get(key)
    return "-" if v is None else fmt.format(v)


def _row(first: list[str], summary: dict[str, Any]) -> list[str]:
    share = summary["pool_share"]
    return [
        *first,
        *(_cell(summary, k, f) for k, _, f in _COLUMNS),
        f"{100 * share['baseline']:.0f}/{100 * share['eagle']:.0f}",
    ]


def table_rows(runs: Sequence[RunResult]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per run its levels (sweep) then its overall summary; with an oracle (a
    sweep simulated with `--oracle`), the best static split's tok/s and the run's ratio to it;
    with prefix caches, the cache hit ratio and the prompt tokens prefilled;
    with several routers (or a scraped view), the routers and how often two routers' views
    disagreed (on the overall row)."""
    oracle = any("oracle_ratio" in level for run in runs for level in run.levels or [])
    cached = any(run.summary.get("cache_hit_ratio") for run in runs)
    extra = ["oracle tok/s", "vs oracle"] if oracle else []
    views = any(run.views is not None for run in runs)
    header = ["run", "conc", *(h for _, h, _ in _COLUMNS), "base/eagle %", *extra]
    if cached:  # prefix caches modelled: how much of the prompts they served
        header += ["cache hit", "prefill tok"]
    if views:
        header += ["routers", "views differ %"]
    rows: list[list[str]] = []

    def cache_cells(summary: dict[str, Any]) -> list[str]:
        if not cached:
            return []
        return [_cell(summary, "cache_hit_ratio", "{:.3f}"), _cell(summary, "prefill_tokens", "{:d}")]

    for run in runs:
        label = run_label(run)
        for level in run.levels or []:
            row = _row([label, str(level["concurrency"])], level)
            if oracle:
                row += [
                    _cell(level, "oracle_throughput_tok_s", "{:.1f}"),
                    _cell(level, "oracle_ratio", "{:.3f}"),
                ]
            rows.append(row + cache_cells(level) + ["-", "-"] * views)
        row = _row([label, "all"], run.summary) + ["-"] * len(extra) + cache_cells(run.summary)
        if views:
            row += _views_cells(run.views)
        rows.append(row)
    return header, rows


def _views_cells(views: dict[str, Any] | None) -> list[str]:
    """`R x S s` and the percentage of router pairs whose views disagreed."""
    if views is None:
        return ["1 (perfect)", "-"]
    interval = views["scrape_interval_s"]
    routers = f"{views['routers']} x {interval:g} s" if interval else f"{views['routers']} (live)"
    return [routers, _cell(views, "view_disagreement", "{:.1%}").rstrip("%")]


def format_table(runs: Sequence[RunResult]) -> str:
    header, rows = table_rows(runs)
    return align_columns(header, rows, left={0})


def write_report(runs: Sequence[RunResult], directory: str | Path, *, title: str, description: str) -> Path:
    """Write `report.md` plus `latency.png` and `throughput.png` into `directory`."""
    d = report_directory(directory)
    import matplotlib.pyplot as plt

    sweep = all(r.levels for r in runs)
    figures: list[tuple[str, str, list[tuple[str, str]]]] = [
        (
            "latency.png",
            "Latency against load",
            [("mean_e2e_s", "mean e2e (s)"), ("p99_ttft_s", "p99 TTFT (s)")],
        ),
        (
            "throughput.png",
            "Throughput against load",
            [("throughput_tok_s", "total tok/s"), ("mean_decode_tok_s", "per-request decode tok/s")],
        ),
    ]
    for filename, fig_title, metrics in figures:
        fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4.2))
        for ax, (key, ylabel) in zip(axes, metrics, strict=True):
            for i, run in enumerate(runs):
                if sweep and run.levels:
                    xs = [lv["concurrency"] for lv in run.levels]
                    ys = [lv[key] if lv[key] is not None else float("nan") for lv in run.levels]
                    ax.plot(xs, ys, marker="o", label=run_label(run))
                else:
                    v = run.summary[key]
                    ax.bar(i, v if v is not None else 0.0, label=run_label(run))
            if sweep:
                ax.set_xscale("log")
                ax.set_xlabel("concurrency (closed-loop clients)")
            else:
                ax.set_xticks([])
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(fig_title)
        fig.tight_layout()
        save_figure(fig, d / filename)

    md = [
        f"# {title}",
        "",
        description,
        "",
        "Simulated with specroute's discrete-event simulator (processor sharing with the profile's",
        "load-dependent decode rate). `n` is the number of measured requests per row.",
        "",
        *markdown_table(*table_rows(runs)),
        "",
        "![latency](latency.png)",
        "",
        "![throughput](throughput.png)",
        "",
    ]
    return write_markdown(d / "report.md", md)
