"""Engines as a seam: what each serving engine (SGLang, vLLM) exports, mapped to one load sample.

How it works: an `Engine` describes one engine's surface: the `/metrics` sample names it exports,
its cheap health path, and what it supports (SGLang's native `/generate` and info routes,
per-request speculative details). A backend's engine is set in the config (`engine`,
`backend_engines`) or detected from what it serves: the first scrape whose `/metrics` has
`sglang:` or `vllm:` samples decides (`detect`). Each engine's parser turns the metric samples it
cares about into a `BackendSample`:

- SGLang exports gauges per rank (`tp_rank`, `pp_rank`, `moe_ep_rank`, `dp_rank`, ...).
  Data-parallel ranks run separate schedulers, so their requests add up; the tensor/pipeline/expert
  ranks of one scheduler report copies of the same state (recent releases report only from rank 0),
  so within one data-parallel rank we take the largest value rather than the sum, which is the
  same as the sum whenever only one rank reports. `spec_accept_length` is already a window average.
- vLLM exports gauges per engine core (`engine` label: data-parallel cores add up) and its
  speculative and prefix-cache signals as lifetime counters, so the accept length is a rate over
  the interval between two scrapes: 1 + Δaccepted / Δdrafts (the bonus token included, as
  SGLang's). While no draft ran in an interval the previous rate is kept. vLLM does not export
  `--max-num-seqs`; `max_running` is then the most requests seen running while others waited for
  capacity (`num_requests_waiting_by_reason{reason="capacity"}`), the cap that actually binds.

Numbers a backend reports are not trusted (issue 37): a sample value that is not finite (`NaN`,
`+Inf`) or larger than `MAX_SAMPLE_VALUE` is dropped as it is read (`read_samples`), and a
`BackendSample` whose values are out of their range is mended by `check_sample`: implausible
running or queued counts reject the whole sample, any other implausible value is dropped (None).
Each rejection is counted by the name of what was rejected, so a scraper can report them.

The parsers are pure; `controller.proxy.scrape` does the HTTP, the budgets and the loop.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("specroute.scrape")

EngineName = Literal["sglang", "vllm"]
EngineSetting = Literal["auto", "sglang", "vllm"]


@dataclass(frozen=True, slots=True)
class Engine:
    """What one serving engine exports and supports."""

    name: EngineName
    label: str
    """How logs and errors name it."""
    prefix: str
    """The prefix of its Prometheus sample names."""
    wanted: frozenset[str]
    """The sample names its parser reads (everything else on `/metrics` is skipped unparsed)."""
    health_path: str
    """Its cheap health probe (no generation)."""
    native_generate: bool
    """Serves SGLang's native `POST /generate` and the `/server_info`, `/model_info` routes."""
    spec_details: bool
    """Honours SGLang's per-request `return_spec_tokens_details`."""
    loads_route: bool
    """May serve SGLang's `GET /v1/loads`."""
    metrics_hint: str
    """What to do when it exports no load metrics."""


SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_QUEUED = "sglang:num_queue_reqs"
SGLANG_ACCEPT = "sglang:spec_accept_length"
SGLANG_THROUGHPUT = "sglang:gen_throughput"
SGLANG_TOKEN_USAGE = "sglang:token_usage"
SGLANG_CACHE_HIT = "sglang:cache_hit_rate"

VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_CACHE_HITS = "vllm:prefix_cache_hits_total"
VLLM_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
VLLM_GENERATED = "vllm:generation_tokens_total"
VLLM_CACHE_CONFIG = "vllm:cache_config_info"

SGLANG = Engine(
    name="sglang",
    label="SGLang",
    prefix="sglang:",
    wanted=frozenset(
        [
            *(SGLANG_RUNNING, SGLANG_QUEUED, SGLANG_ACCEPT),
            *(SGLANG_THROUGHPUT, SGLANG_TOKEN_USAGE, SGLANG_CACHE_HIT),
        ]
    ),
    health_path="/ready",
    native_generate=True,
    spec_details=True,
    loads_route=True,
    metrics_hint="start SGLang with --enable-metrics",
)
VLLM = Engine(
    name="vllm",
    label="vLLM",
    prefix="vllm:",
    wanted=frozenset(
        [
            *(VLLM_RUNNING, VLLM_WAITING, VLLM_WAITING_BY_REASON, VLLM_KV_USAGE, VLLM_ACCEPTED, VLLM_DRAFTS),
            *(VLLM_DRAFT_TOKENS, VLLM_CACHE_HITS, VLLM_CACHE_QUERIES, VLLM_GENERATED, VLLM_CACHE_CONFIG),
        ]
    ),
    health_path="/health",
    native_generate=False,
    spec_details=False,
    loads_route=False,
    metrics_hint="vLLM serves /metrics on its API port unless metrics are disabled",
)
ENGINES: dict[EngineName, Engine] = {"sglang": SGLANG, "vllm": VLLM}
WANTED_SAMPLES = SGLANG.wanted | VLLM.wanted
"""Every sample name any engine's parser reads."""

# Labels that name a copy of the same scheduler state, not a separate scheduler.
_REPLICA_LABELS = frozenset(("tp_rank", "pp_rank", "moe_ep_rank", "attn_tp_rank", "attn_cp_rank"))


@dataclass(frozen=True, slots=True)
class BackendSample:
    """One scrape of one backend. `taken_at` is on the proxy's monotonic clock."""

    running: float
    queued: float
    taken_at: float
    accept_length: float | None = None
    gen_throughput: float | None = None
    source: str = "metrics"
    engine: EngineName = "sglang"
    kv_usage: float | None = None
    """Fraction 0-1 of the KV cache in use."""
    cache_hit_rate: float | None = None
    """Fraction 0-1 of prompt tokens served from the prefix cache (recent interval)."""
    max_running: int | None = None
    """Requests the backend runs at once at most, as it reports it (None: not reported)."""
    cache_tokens: int | None = None
    """KV cache capacity in tokens, as the backend reports it."""


Samples = dict[str, list[tuple[Mapping[str, str], float]]]
Rejected = Counter[str]
"""Values a backend reported that were not taken, by what they were (a sample or field name)."""

MAX_SAMPLE_VALUE = 1e15
"""Largest magnitude of a sample value taken (vLLM's lifetime token counters stay far below it;
a sum of a few thousand such values is still finite)."""
MAX_REQUESTS = 1_000_000
"""Most requests a backend may report running, queued or as its cap (a larger count is absurd)."""
MAX_ACCEPT_LENGTH = 64.0
"""Largest accept length taken: tokens per verify step, at most the draft tokens plus one."""
MAX_TOKENS = 10**12
"""Largest token count (KV cache capacity) or token rate taken."""


def plausible(value: float | None, low: float, high: float) -> bool:
    """Whether `value` is a finite number within [low, high] (None is not)."""
    return value is not None and low <= value <= high  # False for NaN; +-Inf is out of range


def read_samples(
    text: str, wanted: frozenset[str] = WANTED_SAMPLES, rejected: Rejected | None = None
) -> Samples | None:
    """The samples named in `wanted`, by name; None when the text is not Prometheus text. A value
    that is not finite or is larger than `MAX_SAMPLE_VALUE` is dropped (counted in `rejected`)."""
    found: Samples = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in wanted:
                    value = float(s.value)
                    if plausible(value, -MAX_SAMPLE_VALUE, MAX_SAMPLE_VALUE):
                        found[s.name].append((s.labels, value))
                    elif rejected is not None:
                        rejected[s.name] += 1
    except (ValueError, TypeError, IndexError) as e:
        log.debug("unparseable metrics text: %s", e)
        return None
    return found


RANGES: dict[str, tuple[float, float]] = {
    "running": (0, MAX_REQUESTS),
    "queued": (0, MAX_REQUESTS),
    "accept_length": (1e-9, MAX_ACCEPT_LENGTH),
    "gen_throughput": (0, MAX_TOKENS),
    "kv_usage": (0, 1),
    "cache_hit_rate": (0, 1),
    "max_running": (1, MAX_REQUESTS),
    "cache_tokens": (1, MAX_TOKENS),
}
"""The range each value of a `BackendSample` must lie in to be taken."""


def taken(name: str, value: float | None) -> float | None:
    """`value` when it lies in `RANGES[name]`, else None (unknown)."""
    low, high = RANGES[name]
    return value if plausible(value, low, high) else None


def check_sample(sample: BackendSample) -> tuple[BackendSample | None, tuple[str, ...]]:
    """`sample` with its implausible values dropped, and what was dropped: a running or queued
    count out of range (or not finite) rejects the whole sample (None); any other value out of
    its range becomes None."""
    for name in ("running", "queued"):
        if taken(name, getattr(sample, name)) is None:
            return None, (name,)
    bad = tuple(
        name for name in RANGES if (value := getattr(sample, name)) is not None and taken(name, value) is None
    )
    changes: dict[str, Any] = dict.fromkeys(bad)
    return (replace(sample, **changes) if bad else sample), bad


def detect(names: Iterable[str]) -> Engine | None:
    """The engine whose sample names appear (SGLang first when, oddly, both do)."""
    seen = set(names)
    for engine in (SGLANG, VLLM):
        if any(n.startswith(engine.prefix) for n in seen):
            return engine
    return None


def _scheduler_key(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in _REPLICA_LABELS))


def aggregate(samples: Iterable[tuple[Mapping[str, str], float]]) -> float | None:
    """Max within a scheduler's replica ranks, summed across schedulers; None without samples."""
    per_scheduler: dict[tuple[tuple[str, str], ...], float] = {}
    for labels, value in samples:
        key = _scheduler_key(labels)
        prev = per_scheduler.get(key)
        per_scheduler[key] = value if prev is None else max(prev, value)
    if not per_scheduler:
        return None
    return sum(per_scheduler.values())


def _mean(samples: Iterable[tuple[Mapping[str, str], float]], positive: bool = False) -> float | None:
    values = [v for _, v in samples if not positive or v > 0]
    return sum(values) / len(values) if values else None


def sglang_sample(found: Samples, taken_at: float) -> BackendSample | None:
    """SGLang's gauges as one sample; None without its scheduler gauges."""
    running = aggregate(found.get(SGLANG_RUNNING, ()))
    if running is None:
        return None
    return BackendSample(
        running=running,
        queued=aggregate(found.get(SGLANG_QUEUED, ())) or 0.0,
        taken_at=taken_at,
        # A plain server reports 0: unknown, not "no token accepted".
        accept_length=_mean(found.get(SGLANG_ACCEPT, ()), positive=True),
        gen_throughput=aggregate(found.get(SGLANG_THROUGHPUT, ())),
        source="metrics",
        engine="sglang",
        kv_usage=_mean(found.get(SGLANG_TOKEN_USAGE, ())),
        cache_hit_rate=_mean(found.get(SGLANG_CACHE_HIT, ())),
    )


def _count(value: object) -> int | None:
    """A positive request count as SGLang writes one (an int or a whole float), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value < 2**31:
        return None
    return int(value) if value == int(value) else None


def server_info_cap(info: object) -> int | None:
    """The running-request cap in SGLang's `/server_info` (`/get_server_info`): the sum over
    data-parallel ranks of `internal_states[].effective_max_running_requests_per_dp` (what the
    schedulers apply, which can be below the launch argument when memory bounds it), else the
    `max_running_requests` launch argument (null when unset); None when neither is a positive
    count. The one reading of it: the scraper's admission bound and view, `specroute bench`'s
    profile."""
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    if isinstance(states, list) and states:
        caps = [
            _count(s.get("effective_max_running_requests_per_dp")) if isinstance(s, dict) else None
            for s in states
        ]
        if all(c is not None for c in caps):
            return sum(c for c in caps if c is not None)
    return _count(info.get("max_running_requests"))


def parse_sglang_metrics(text: str, taken_at: float) -> BackendSample | None:
    """Parse SGLang's Prometheus text; None when it has no scheduler gauges (or is garbage)."""
    found = read_samples(text, SGLANG.wanted)
    return None if found is None else sglang_sample(found, taken_at)


@dataclass(frozen=True, slots=True)
class VllmCounters:
    """vLLM's lifetime counters at one scrape, and what was derived from them so far: the state a
    rate needs between two scrapes."""

    taken_at: float
    accepted: float | None
    drafts: float | None
    generated: float | None
    cache_hits: float | None
    cache_queries: float | None
    accept_length: float | None = None
    cache_hit_rate: float | None = None
    cap_seen: int | None = None
    """The most requests seen running while others waited for capacity."""
    cap_confirmations: int = 0
    """Scrapes that saw exactly `cap_seen` running with requests waiting."""


CAP_CONFIRMATIONS = 3
"""Scrapes that must see the same full batch (requests waiting for capacity) before it is reported
as the backend's cap: a single sample may catch requests that arrived between two steps."""


def _rate(now: float | None, before: float | None) -> float | None:
    """The counter's increase; None when unknown or when it went backwards (a restart)."""
    if now is None or before is None or now < before:
        return None
    return now - before


def _reason(found: Samples, reason: str) -> float | None:
    return aggregate(
        ({k: v for k, v in labels.items() if k != "reason"}, value)
        for labels, value in found.get(VLLM_WAITING_BY_REASON, ())
        if labels.get("reason") == reason
    )


def _kv_capacity(found: Samples) -> int | None:
    total = 0
    for labels, _ in found.get(VLLM_CACHE_CONFIG, ()):
        try:
            total += int(labels.get("kv_cache_size_tokens", ""))
        except ValueError:
            return None
    return total or None


def vllm_sample(
    found: Samples, taken_at: float, previous: VllmCounters | None
) -> tuple[BackendSample, VllmCounters] | None:
    """vLLM's gauges and counter rates as one sample, and the counters for the next scrape; None
    without its scheduler gauges."""
    running = aggregate(found.get(VLLM_RUNNING, ()))
    if running is None:
        return None
    queued = aggregate(found.get(VLLM_WAITING, ())) or 0.0
    counters = VllmCounters(
        taken_at=taken_at,
        accepted=aggregate(found.get(VLLM_ACCEPTED, ())),
        drafts=aggregate(found.get(VLLM_DRAFTS, ())),
        generated=aggregate(found.get(VLLM_GENERATED, ())),
        cache_hits=aggregate(found.get(VLLM_CACHE_HITS, ())),
        cache_queries=aggregate(found.get(VLLM_CACHE_QUERIES, ())),
    )
    accept = hit_rate = throughput = None
    cap_seen = previous.cap_seen if previous is not None else None
    confirmations = previous.cap_confirmations if previous is not None else 0
    if previous is not None:
        accept, hit_rate = previous.accept_length, previous.cache_hit_rate
        drafts = _rate(counters.drafts, previous.drafts)
        accepted = _rate(counters.accepted, previous.accepted)
        if drafts and accepted is not None:
            accept = 1.0 + accepted / drafts
        queries = _rate(counters.cache_queries, previous.cache_queries)
        hits = _rate(counters.cache_hits, previous.cache_hits)
        if queries and hits is not None:
            hit_rate = hits / queries
        generated = _rate(counters.generated, previous.generated)
        span = taken_at - previous.taken_at
        if generated is not None and span > 0:
            throughput = generated / span
    waiting_for_capacity = _reason(found, "capacity")
    if (waiting_for_capacity if waiting_for_capacity is not None else queued) > 0 and running >= 1:
        full = round(running)
        if cap_seen is None or full > cap_seen:
            cap_seen, confirmations = full, 1
        elif full == cap_seen:
            confirmations += 1
    counters = replace(
        counters,
        accept_length=accept,
        cache_hit_rate=hit_rate,
        cap_seen=cap_seen,
        cap_confirmations=confirmations,
    )
    max_running = cap_seen if confirmations >= CAP_CONFIRMATIONS else None
    sample = BackendSample(
        running=running,
        queued=queued,
        taken_at=taken_at,
        accept_length=accept,
        gen_throughput=throughput,
        source="metrics",
        engine="vllm",
        kv_usage=_mean(found.get(VLLM_KV_USAGE, ())),
        cache_hit_rate=hit_rate,
        max_running=max_running,
        cache_tokens=_kv_capacity(found),
    )
    return sample, counters


def parse_vllm_metrics(
    text: str, taken_at: float, previous: VllmCounters | None = None
) -> tuple[BackendSample, VllmCounters] | None:
    """Parse vLLM's Prometheus text (see `vllm_sample`); None without its gauges or for garbage."""
    found = read_samples(text, VLLM.wanted)
    return None if found is None else vllm_sample(found, taken_at, previous)
