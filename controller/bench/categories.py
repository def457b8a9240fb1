"""Acceptance and speed per prompt category (`specroute bench --prompts FILE` whose lines carry a
`category`): what an EAGLE drafter gains on each kind of request.

Per category, over the measured successful requests of every level: the accept length (tokens
per verify step, from each request's `spec_tokens_details`, which bench asks for when the
prompts have categories, or from vLLM's `metrics.speculative_decoding` when it runs with
`--per-request-spec-decode-metrics`; a server that sends neither but counts accepted and drafted
tokens, as vLLM does on `/metrics`, gets a probe after the sweep instead: `CATEGORY_PROBE` requests per
category one at a time, each's accept length from the counters' deltas around it) and the
per-request decode rate, each as a mean with its 95% t-interval (`policies.stats.estimate`). A
category's speed factor is its mean accept length over the reference accept length (the
server's average over the run, else the mean over every measured request): written into the
profile's eagle mode as `categories`, it is `cost_model`'s prior for requests whose
`x-specroute-hint` names the category (and for the content model's fallback).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from controller.bench.result import LevelResult
from policies.stats import Estimate, estimate


@dataclass(frozen=True)
class CategorySummary:
    category: str
    n: int
    accept_length: Estimate | None
    decode_tok_s: Estimate | None

    def to_json(self) -> dict[str, Any]:
        def est(e: Estimate | None) -> dict[str, Any] | None:
            return None if e is None else {"n": e.n, "mean": e.mean, "half_width": e.half_width}

        return {
            "category": self.category,
            "n": self.n,
            "accept_length": est(self.accept_length),
            "decode_tok_s": est(self.decode_tok_s),
        }


def by_category(
    levels: Sequence[LevelResult], probe: dict[str, list[float]] | None = None
) -> list[CategorySummary]:
    """One summary per category, sorted by name (requests without a category are left out);
    `probe`'s accept lengths (the counter probe's, per category) where no request had its own."""
    accepts: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for lv in levels:
        for r in lv.requests:
            if r.phase != "measured" or not r.ok or r.category is None:
                continue
            counts[r.category] = counts.get(r.category, 0) + 1
            if r.accept_length is not None:
                accepts.setdefault(r.category, []).append(r.accept_length)
            if r.decode_tok_s is not None:
                rates.setdefault(r.category, []).append(r.decode_tok_s)
    if probe and not accepts:
        accepts = {c: list(values) for c, values in probe.items() if c in counts and values}
    return [
        CategorySummary(c, counts[c], estimate(accepts.get(c, [])), estimate(rates.get(c, [])))
        for c in sorted(counts)
    ]


def category_factors(summaries: Sequence[CategorySummary], reference: float | None) -> dict[str, float]:
    """Speed factor per category with a measured accept length: its mean over `reference` (None:
    the mean accept length over every request measured)."""
    measured = [s for s in summaries if s.accept_length is not None]
    if not measured:
        return {}
    if reference is None or not reference > 0:
        total = sum(s.accept_length.mean * s.accept_length.n for s in measured if s.accept_length)
        reference = total / sum(s.accept_length.n for s in measured if s.accept_length)
    return {s.category: round(s.accept_length.mean / reference, 4) for s in measured if s.accept_length}


def describe(summaries: Sequence[CategorySummary], factors: dict[str, float], probed: bool = False) -> str:
    """The per-category table bench prints (mean ± 95% CI half-width)."""

    def fmt(e: Estimate | None, digits: int) -> str:
        if e is None:
            return "-"
        ci = "?" if e.half_width is None else f"{e.half_width:.{digits}f}"
        return f"{e.mean:.{digits}f} ± {ci} (n={e.n})"

    lines = ["per category (measured requests of every level; mean ± 95% CI):"]
    for s in summaries:
        factor = factors.get(s.category)
        lines.append(
            f"  {s.category:<16} n={s.n:<5} accept length {fmt(s.accept_length, 3)}  "
            f"decode {fmt(s.decode_tok_s, 1)} tok/s"
            + ("" if factor is None else f"  speed factor {factor:.3f}")
        )
    if probed and any(s.accept_length for s in summaries):
        lines.append(
            "  (accept lengths from the server's accepted/drafted token counters around each of the probe's "
            "requests, sent one at a time after the sweep: exact only while no one else uses the server)"
        )
    if not any(s.accept_length for s in summaries):
        lines.append(
            "  (no accept lengths: the server did not send spec_tokens_details and counts no accepted "
            "and drafted tokens; an SGLang EAGLE server answers return_spec_tokens_details, vLLM counts "
            "them on /metrics)"
        )
    return "\n".join(lines)
