"""Summaries of simulated runs: the `S` objects of `specroute simulate --json`.

Per measured request: TTFT = first token - arrival (queue wait included), e2e = finish -
arrival, decode rate = (tokens - 1) / (finish - first token) for requests with at least 2
tokens. Throughput = output tokens emitted by all requests (warm-up and fillers included,
spread evenly after each one's first token) between the first measured arrival and the last
measured finish, over that makespan, exactly as `specroute bench` computes a level's total;
for an open loop that is all output tokens / makespan, and a sweep's overall summary adds the
levels' tokens and makespans. Percentiles interpolate linearly between order statistics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from simulator.engine import MEASURED, NOT_SENT, RawRun


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(frozen=True)
class Samples:
    """Per-request figures of the measured requests of one segment."""

    ttft: list[float]
    e2e: list[float]
    decode: list[float]
    tpot: list[float | None]
    tokens: float
    makespan: float
    pools: dict[str, int]


def samples(run: RawRun) -> Samples:
    ttft: list[float] = []
    e2e: list[float] = []
    decode: list[float] = []
    tpot: list[float | None] = []
    pools = {"baseline": 0, "eagle": 0}
    start = math.inf
    end = -math.inf
    pool_names = [m.pool for m in run.servers]
    arrival, first, finish, out = run.arrival, run.first_token, run.finish, run.output_tokens
    for i, ph in enumerate(run.phase):
        if ph != MEASURED:
            continue
        a, f, z, n = arrival[i], first[i], finish[i], out[i]
        ttft.append(f - a)
        e2e.append(z - a)
        if n >= 2 and z > f:
            decode.append((n - 1) / (z - f))
            tpot.append((z - f) / (n - 1))
        else:
            tpot.append(None)
        pools[pool_names[run.server[i]]] += 1
        start = min(start, a)
        end = max(end, z)
    tokens = 0.0
    if e2e:
        parts = []
        for i, ph in enumerate(run.phase):
            if ph == NOT_SENT:
                continue
            f, z, n = first[i], finish[i], out[i]
            if z <= f or n < 2:
                parts.append(float(n) if start <= f <= end else 0.0)
                continue
            got = 1.0 if start <= f <= end else 0.0
            overlap = max(0.0, min(end, z) - max(start, f))
            parts.append(got + (n - 1) * overlap / (z - f))
        tokens = math.fsum(parts)
    return Samples(ttft, e2e, decode, tpot, tokens, max(end - start, 0.0) if e2e else 0.0, pools)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def _nan_to_none(v: float) -> float | None:
    return None if math.isnan(v) else v


def summarize(parts: Sequence[Samples]) -> dict[str, Any]:
    """The `S` object over one or more segments' samples."""
    ttft = sorted(x for p in parts for x in p.ttft)
    e2e = sorted(x for p in parts for x in p.e2e)
    decode = [x for p in parts for x in p.decode]
    requests = len(e2e)
    tokens = math.fsum(p.tokens for p in parts)
    makespan = math.fsum(p.makespan for p in parts)
    share = {
        pool: (sum(p.pools[pool] for p in parts) / requests if requests else 0.0)
        for pool in ("baseline", "eagle")
    }
    out: dict[str, Any] = {
        "requests": requests,
        "mean_ttft_s": _mean(ttft),
        "p50_ttft_s": percentile(ttft, 50),
        "p99_ttft_s": percentile(ttft, 99),
        "mean_e2e_s": _mean(e2e),
        "p50_e2e_s": percentile(e2e, 50),
        "p99_e2e_s": percentile(e2e, 99),
        "mean_decode_tok_s": _mean(decode),
        "throughput_tok_s": tokens / makespan if makespan > 0 else math.nan,
        "pool_share": share,
    }
    return {k: (_nan_to_none(v) if isinstance(v, float) else v) for k, v in out.items()}


def goodput(parts: Sequence[Samples], slo: Slo) -> float:
    """Requests per second (over the makespan) that met both SLOs (an unset SLO always holds)."""
    good = 0
    for p in parts:
        for ttft, tpot in zip(p.ttft, p.tpot, strict=True):
            if slo.ttft_s is not None and ttft > slo.ttft_s:
                continue
            if slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s:
                continue
            good += 1
    makespan = math.fsum(p.makespan for p in parts)
    return good / makespan if makespan > 0 else 0.0


@dataclass(frozen=True)
class RunResult:
    """One policy on one deployment over the whole workload."""

    policy: str
    params: Mapping[str, Any]
    deployment: Mapping[str, int]
    summary: dict[str, Any]
    levels: list[dict[str, Any]] | None
    samples: list[Samples]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy,
            "params": dict(self.params),
            "deployment": dict(self.deployment),
            "summary": self.summary,
        }
        if self.levels is not None:
            out["levels"] = self.levels
        return out
