"""Output of `specroute plan`: ranking tables, the JSON document, the markdown report and plot.

matplotlib is an optional extra: it is imported only when a report is written, and its absence
is a clear `ReportError`, not a traceback.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from simulator.engine.report import (
    align_columns,
    markdown_table,
    report_directory,
    save_figure,
    write_markdown,
)
from simulator.engine.runner import SINGLE_POOL_POLICY
from simulator.planning.plan import Entry, LoadResult, PlanResult


def policy_label(e: Entry) -> str:
    c = e.choice
    if c.name == SINGLE_POOL_POLICY:
        return SINGLE_POOL_POLICY
    params = ",".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in c.params.items())
    tuned = f" (best of {e.tuned_points})" if e.tuned_points else ""
    return f"{c.name}:{params}{tuned}" if params else f"{c.name}{tuned}"


def _num(v: float, fmt: str) -> str:
    return "-" if math.isnan(v) else fmt.format(v)


def _pm(mean: float, half: float, fmt: str) -> str:
    if math.isnan(mean):
        return "-"
    if math.isnan(half) or half <= 1e-9 * abs(mean):
        return fmt.format(mean)  # one seed, or identical runs (to rounding): no interval to show
    return fmt.format(mean) + f" ±{half:.2g}"


def table_rows(lr: LoadResult, objective: str) -> tuple[list[str], list[list[str]]]:
    header = [
        "rank",
        "deployment",
        "policy",
        f"{objective} (95% CI)",
        "TTFT mean s",
        "TTFT p99 s",
        "e2e mean s",
        "e2e p99 s",
        "tok/s",
        "base/eagle %",
        "margin to next (95% CI)",
    ]
    fmt = "{:.4g}"
    rows = []
    for i, r in enumerate(lr.ranking, 1):
        e = r.entry
        share = e.pool_share()
        if r.margin is None:
            margin = ""
        else:
            d = r.margin.diff
            exact = math.isnan(d.half) or d.half <= 1e-9 * abs(d.mean)  # one seed, or identical runs
            ci = "" if exact else f" [{d.low:.3g}, {d.high:.3g}]"
            margin = f"{_num(d.mean, '{:.3g}')}{ci} {r.margin.verdict}"
        rows.append(
            [
                str(i),
                e.label,
                policy_label(e),
                _pm(e.score.mean, e.score.half, fmt),
                _num(e.mean("mean_ttft_s"), "{:.3f}"),
                _num(e.mean("p99_ttft_s"), "{:.3f}"),
                _num(e.mean("mean_e2e_s"), "{:.2f}"),
                _num(e.mean("p99_e2e_s"), "{:.2f}"),
                _num(e.mean("throughput_tok_s"), "{:.1f}"),
                f"{100 * share['baseline']:.0f}/{100 * share['eagle']:.0f}",
                margin,
            ]
        )
    return header, rows


def format_table(lr: LoadResult, objective: str) -> str:
    header, rows = table_rows(lr, objective)
    return align_columns(header, rows, left={1, 2, 10}, strip=True)


def headline(lr: LoadResult) -> str:
    best = lr.ranking[0]
    if len(lr.ranking) == 1:
        return f"best: {best.entry.label} (the only deployment)"
    if lr.tied_with_best:
        return f"best: {best.entry.label}, but within the noise of {', '.join(lr.tied_with_best)}: a tie"
    m = best.margin
    verdict = m.verdict if m is not None else "n/a"
    if verdict == "n/a":
        return f"best: {best.entry.label} (one seed: no confidence interval, use more --seeds)"
    return f"best: {best.entry.label}, ahead of {lr.ranking[1].entry.label} beyond the noise"


def flips(result: PlanResult) -> str | None:
    winners = [(lr.factor, lr.best.label) for lr in result.loads]
    if len({w for _, w in winners}) <= 1:
        return None
    ties = {lr.factor for lr in result.loads if lr.tied_with_best}
    return "the best deployment changes with load: " + "; ".join(
        f"{f:g}x -> {w}{' (a tie)' if f in ties else ''}" for f, w in winners
    )


def format_plan(result: PlanResult, description: str) -> str:
    spec = result.spec
    better = "higher" if spec.higher_is_better else "lower"
    out = [
        description,
        f"objective: {spec.objective} ({better} is better); {len(spec.seeds)} evaluation seeds "
        f"({', '.join(map(str, spec.seeds))}), policies tuned on separate seeds; "
        f"{result.simulations} simulations; a margin inside its 95% CI or under "
        f"{100 * spec.tie_within:g}% is a tie",
    ]
    for lr in result.loads:
        out += ["", f"== load {lr.factor:g}x ==", format_table(lr, spec.objective), headline(lr)]
    note = flips(result)
    if note:
        out += ["", note]
    return "\n".join(out)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    return v


_MEAN_KEYS = (
    "mean_ttft_s",
    "p50_ttft_s",
    "p99_ttft_s",
    "mean_e2e_s",
    "p50_e2e_s",
    "p99_e2e_s",
    "mean_decode_tok_s",
    "throughput_tok_s",
)


def entry_json(e: Entry) -> dict[str, Any]:
    return {
        "deployment": {k: n for k, n in e.deployment},
        "policy": e.choice.name,
        "params": dict(e.choice.params),
        "tuned_points": e.tuned_points,
        "objective": {**e.score.to_json(), "per_seed": list(e.scores)},
        "goodput_rps": list(e.goodputs),
        "summary": {
            "requests": e.summaries[0].get("requests"),
            **{k: e.mean(k) for k in _MEAN_KEYS},
            "pool_share": e.pool_share(),
        },
    }


def plan_json(result: PlanResult, config_path: str | None) -> dict[str, Any]:
    spec = result.spec
    loads = []
    for lr in result.loads:
        ranking = []
        for i, r in enumerate(lr.ranking, 1):
            ranking.append(
                {"rank": i, **entry_json(r.entry), "margin_to_next": r.margin.to_json() if r.margin else None}
            )
        loads.append(
            {
                "factor": lr.factor,
                "best": lr.best.label,
                "tied_with_best": lr.tied_with_best,
                "ranking": ranking,
            }
        )
    doc = {
        "objective": spec.objective,
        "higher_is_better": spec.higher_is_better,
        "servers": spec.servers,
        "kinds": list(spec.kinds),
        "policies": list(spec.policies),
        "seeds": list(spec.seeds),
        "tuning_seeds": list(spec.tuning_seeds),
        "simulations": result.simulations,
        "loads": loads,
        "winner": result.reference.best.label,
        "config": config_path,
    }
    return dict(_clean(doc))


def write_report(
    result: PlanResult, directory: str | Path, *, description: str, config_path: str | None
) -> Path:
    """Write `report.md` and `objective_vs_load.png` into `directory`."""
    d = report_directory(directory)
    import matplotlib.pyplot as plt

    spec = result.spec
    factors = [lr.factor for lr in result.loads]
    labels = [r.entry.label for r in result.reference.ranking]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label in labels:
        means, halves = [], []
        for lr in result.loads:
            score = next(r.entry for r in lr.ranking if r.entry.label == label).score
            means.append(score.mean)
            halves.append(0.0 if math.isnan(score.half) else score.half)
        ax.errorbar(factors, means, yerr=halves, marker="o", capsize=3, label=label)
    ax.set_xlabel("load factor (x the workload's rate / concurrency)")
    ax.set_ylabel(f"{spec.objective} ({'higher' if spec.higher_is_better else 'lower'} is better)")
    ax.set_xticks(factors)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{spec.servers} servers: {spec.objective} per deployment against load")
    fig.tight_layout()
    save_figure(fig, d / "objective_vs_load.png")

    md = [
        f"# specroute plan: {spec.servers} servers",
        "",
        description,
        "",
        f"Objective `{spec.objective}`; each figure is the mean over {len(spec.seeds)} evaluation seeds "
        f"({', '.join(map(str, spec.seeds))}) with its 95% t-interval; the margin to the next "
        "deployment is a paired 95% interval over the same seeds, and a margin whose interval "
        f"holds zero, or that is under {100 * spec.tie_within:g}% of the objective, is a tie. "
        "Mixed deployments were tuned on separate seeds. Error bars in the plot are the 95% intervals.",
        "",
    ]
    for lr in result.loads:
        table = markdown_table(*table_rows(lr, spec.objective))
        md += [f"## Load {lr.factor:g}x", "", *table, "", headline(lr), ""]
    note = flips(result)
    if note:
        md += [note, ""]
    if config_path:
        md += [f"Config for the winner at 1x: `{config_path}`", ""]
    md += ["![objective against load](objective_vs_load.png)", ""]
    return write_markdown(d / "report.md", md)
