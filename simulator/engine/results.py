"""Summaries of simulated runs: the `S` objects of `specroute simulate --json`.

Per measured request: TTFT = first token - arrival (queue wait included), e2e = finish -
arrival, decode rate = (tokens - 1) / (finish - first token) for requests with at least 2
tokens. Throughput = output tokens emitted by all requests (warm-up and fillers included,
spread evenly after each one's first token) between the first measured arrival and the last
measured finish, over that makespan, exactly as `specroute bench` computes a level's total;
for an open loop that is all output tokens / makespan, and a sweep's overall summary adds the
levels' tokens and makespans. Percentiles interpolate linearly between order statistics.

Prefix caches: `prefill_tokens` = prompt tokens of the measured requests that were prefilled
(not found in their server's cache), `cache_hit_ratio` = cached / all prompt tokens (0 when no
cache is modelled), overall and per server (`servers`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from policies.stats import percentile
from simulator.engine.loop import MEASURED, NOT_SENT, RawRun

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(frozen=True)
class Samples:
    """Per-request figures of the measured requests of one segment (lists or float arrays)."""

    ttft: Sequence[float]
    e2e: Sequence[float]
    decode: Sequence[float]
    tpot: Sequence[float | None] | FloatArray
    """None (or NaN) for a request with a single output token."""
    tokens: float
    makespan: float
    pools: dict[str, int]
    servers: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    """Per server: measured requests, their prompt tokens, and the prompt tokens found cached."""


def samples(run: RawRun) -> Samples:
    """The measured requests' figures of one run, computed on arrays.

    Every element gets the same float operations a plain loop would apply and sums use
    `math.fsum`, so the figures do not depend on how they were computed."""
    phase = np.asarray(run.phase, dtype=np.int8)
    arrival = np.asarray(run.arrival, dtype=np.float64)
    first = np.asarray(run.first_token, dtype=np.float64)
    finish = np.asarray(run.finish, dtype=np.float64)
    out = np.asarray(run.output_tokens, dtype=np.float64)
    measured = phase == MEASURED
    a, f, z, n = arrival[measured], first[measured], finish[measured], out[measured]
    if not len(a):
        return Samples([], [], [], [], 0.0, 0.0, {"baseline": 0, "eagle": 0})
    decodes = (n >= 2) & (z > f)
    decode = (n[decodes] - 1) / (z[decodes] - f[decodes])
    tpot = np.where(decodes, (z - f) / np.where(decodes, n - 1, 1.0), np.nan)
    on_eagle_server = np.array([m.pool == "eagle" for m in run.servers], dtype=np.bool_)
    on_eagle = int(on_eagle_server[np.asarray(run.server, dtype=np.int64)[measured]].sum())
    start, end = float(a.min()), float(z.max())
    # Output tokens emitted between the first measured arrival and the last measured finish:
    # the first token if it came inside the window, the rest spread evenly after it.
    sent = phase != NOT_SENT
    fs, zs, ns = first[sent], finish[sent], out[sent]
    inside = ((start <= fs) & (fs <= end)).astype(np.float64)
    whole = (zs <= fs) | (ns < 2)
    overlap = np.maximum(0.0, np.minimum(end, zs) - np.maximum(start, fs))
    spread = (ns - 1) * overlap / np.where(whole, 1.0, zs - fs)
    parts = np.where(whole, ns * inside, inside + spread)
    servers: dict[str, tuple[int, float, float]] = {}
    where = np.asarray(run.server, dtype=np.int64)
    prompt = (
        np.asarray(run.prompt_tokens, dtype=np.float64) if len(run.prompt_tokens) else np.zeros(len(where))
    )
    hit = (
        np.asarray(run.cached_tokens, dtype=np.float64)
        if run.cached_tokens is not None
        else np.zeros(len(where))
    )
    for i, server in enumerate(run.servers):
        on = measured & (where == i)
        servers[server.name] = (int(on.sum()), math.fsum(prompt[on].tolist()), math.fsum(hit[on].tolist()))
    return Samples(
        f - a,
        z - a,
        decode,
        tpot,
        math.fsum(parts.tolist()),
        max(end - start, 0.0),
        {"baseline": len(a) - on_eagle, "eagle": on_eagle},
        servers,
    )


def _percentile(values: Sequence[float], q: float) -> float:
    """`policies.stats.percentile`, NaN for no values (a run that measured none)."""
    return percentile(values, q) if values else math.nan


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if len(values) else math.nan


def _joined(parts: Sequence[Sequence[float]]) -> FloatArray:
    return np.concatenate([np.asarray(p, dtype=np.float64) for p in parts]) if parts else np.zeros(0)


def _nan_to_none(v: float) -> float | None:
    return None if math.isnan(v) else v


def summarize(parts: Sequence[Samples]) -> dict[str, Any]:
    """The `S` object over one or more segments' samples."""
    ttft = np.sort(_joined([p.ttft for p in parts])).tolist()
    e2e = np.sort(_joined([p.e2e for p in parts])).tolist()
    decode = _joined([p.decode for p in parts]).tolist()
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
        "p50_ttft_s": _percentile(ttft, 50),
        "p99_ttft_s": _percentile(ttft, 99),
        "mean_e2e_s": _mean(e2e),
        "p50_e2e_s": _percentile(e2e, 50),
        "p99_e2e_s": _percentile(e2e, 99),
        "mean_decode_tok_s": _mean(decode),
        "throughput_tok_s": tokens / makespan if makespan > 0 else math.nan,
        "pool_share": share,
        **_cache_figures([p.servers for p in parts]),
    }
    return {k: (_nan_to_none(v) if isinstance(v, float) else v) for k, v in out.items()}


def _cache_figures(per_part: Sequence[Mapping[str, tuple[int, float, float]]]) -> dict[str, Any]:
    """`cache_hit_ratio` and `prefill_tokens`, overall and per server."""
    totals: dict[str, list[float]] = {}
    for servers in per_part:
        for name, (requests, prompt, hit) in servers.items():
            t = totals.setdefault(name, [0.0, 0.0, 0.0])
            t[0] += requests
            t[1] += prompt
            t[2] += hit

    def figures(prompt: float, hit: float) -> dict[str, Any]:
        return {
            "cache_hit_ratio": hit / prompt if prompt > 0 else None,
            "prefill_tokens": round(prompt - hit),
        }

    prompt = math.fsum(t[1] for t in totals.values())
    hit = math.fsum(t[2] for t in totals.values())
    return {
        **figures(prompt, hit),
        "servers": {name: {"requests": int(t[0]), **figures(t[1], t[2])} for name, t in totals.items()},
    }


def goodput(parts: Sequence[Samples], slo: Slo) -> float:
    """Requests per second (over the makespan) that met both SLOs (an unset SLO always holds)."""
    good = 0
    for p in parts:
        for ttft, tpot in zip(p.ttft, p.tpot, strict=True):
            if slo.ttft_s is not None and ttft > slo.ttft_s:
                continue
            if slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s:  # NaN: one token
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
    views: dict[str, Any] | None = None
    """Several routers or a scraped view (`simulator.engine.replica_views`): the setup and how often
    the routers' views disagreed; None for one router with the perfect view."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy,
            "params": dict(self.params),
            "deployment": dict(self.deployment),
            "summary": self.summary,
        }
        if self.levels is not None:
            out["levels"] = self.levels
        if self.views is not None:
            out["routers"] = self.views
        return out
