"""Prometheus metrics of the proxy, on a `CollectorRegistry` passed in (never the global one).

In-flight, health and scraped-backend gauges are not updated on the hot path: a collector reads
them from the `LoadTracker` at scrape time, so they are exactly the tracker's state (scraped
values only while their sample is fresh). Counters and histograms cache their labelled children
so a request costs a dict lookup and an `inc()`/`observe()` per metric. Labels are bounded:
pools, configured backends, policy names and their short reasons, never a request or a prompt.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.proxy.load import LoadTracker
from controller.proxy.memory import MemoryBudget
from controller.proxy.watchdog import RelayWatchdog
from policies.base import Outcome

# Buckets that fit LLM serving: TTFT 10 ms..60 s, whole requests up to 10 min, decode rates
# 1..1000 tok/s per request, and the proxy's own overhead, a fraction of a millisecond, up to 1 s.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
DECODE_RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 500.0, 1000.0)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
PREFIX_RATIO_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _TrackerCollector(Collector):
    def __init__(self, tracker: LoadTracker, clock: Callable[[], float]) -> None:
        self._tracker = tracker
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "backend"]
        in_flight = GaugeMetricFamily(
            "specroute_in_flight_requests",
            "Requests this proxy has in flight, per backend, counted in sequences as the backend runs "
            "them (a request with n: 4 counts 4).",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "specroute_backend_healthy", "1 when the backend is healthy, else 0.", labels=labels
        )
        running = GaugeMetricFamily(
            "specroute_backend_running_requests",
            "Running requests the backend reported in its latest fresh sample (all clients).",
            labels=labels,
        )
        queued = GaugeMetricFamily(
            "specroute_backend_queued_requests",
            "Waiting requests the backend reported in its latest fresh sample (all clients).",
            labels=labels,
        )
        accept = GaugeMetricFamily(
            "specroute_backend_spec_accept_length",
            "Mean accepted tokens per verify step the backend reported (speculative backends).",
            labels=labels,
        )
        age = GaugeMetricFamily(
            "specroute_backend_sample_age_seconds",
            "Age of the backend's latest load sample (absent before the first).",
            labels=labels,
        )
        ejected = GaugeMetricFamily(
            "specroute_backend_ejected",
            "1 while the outlier detector keeps the backend out of routing, else 0.",
            labels=labels,
        )
        bound = GaugeMetricFamily(
            "specroute_backend_max_in_flight",
            "Admission bound: requests this proxy sends to the backend at once, in sequences (absent: "
            "unbounded).",
            labels=labels,
        )
        now = self._clock()
        stale = self._tracker.stale_after_s
        for b in self._tracker:
            key = [b.pool, b.name]
            in_flight.add_metric(key, b.in_flight)
            healthy.add_metric(key, 1.0 if b.healthy else 0.0)
            ejected.add_metric(key, 1.0 if b.ejected(now) else 0.0)
            if b.max_in_flight is not None:
                bound.add_metric(key, b.max_in_flight)
            if b.sample_time is None:
                continue
            age.add_metric(key, max(0.0, now - b.sample_time))
            if now - b.sample_time > stale:
                continue
            if b.running is not None:
                running.add_metric(key, b.running)
                queued.add_metric(key, b.queued or 0)
            if b.accept_length is not None:
                accept.add_metric(key, b.accept_length)
        yield from (in_flight, healthy, running, queued, accept, age, ejected, bound)


class BudgetCollector(Collector):
    """The memory budget (`controller.proxy.memory`) as it stands at scrape time: its limit, what
    requests hold of it, and how often it refused work (a request body answered 503, a backend's
    answer 502, a large first event that waited in vain)."""

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget

    def collect(self) -> Iterator[Metric]:
        b = self._budget
        yield GaugeMetricFamily(
            "specroute_memory_budget_bytes", "The memory budget (memory_budget_bytes).", value=b.limit
        )
        yield GaugeMetricFamily(
            "specroute_memory_budget_used_bytes",
            "Bytes of the memory budget requests hold now (bodies, first events, held-back bytes, answers).",
            value=b.used,
        )
        yield GaugeMetricFamily(
            "specroute_memory_budget_waiting",
            "Large bodies and first events waiting for room in the memory budget now (reading nothing).",
            value=b.waiting,
        )
        yield CounterMetricFamily(
            "specroute_memory_budget_refusals",
            "Work refused because the memory budget could not hold it (503 bodies, 502 answers).",
            value=b.refusals,
        )


class RelayCollector(Collector):
    """Streams whose write to the client is blocked at scrape time: their relay (`RelayWatchdog`
    in `relays`) waits for a client that reads slower than the stream, or not at all (given up
    after `client_write_timeout_s`)."""

    def __init__(self, relays: set[RelayWatchdog]) -> None:
        self._relays = relays

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "specroute_client_writes_blocked",
            "Streamed answers whose write to the client is blocked now (a client slower than its stream).",
            value=sum(1 for dog in self._relays if dog.side == "client"),
        )


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        tracker: LoadTracker,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.registry = registry
        self._declare_routing(registry)
        self._declare_speeds(registry)
        self._declare_prefixes(registry)
        registry.register(_TrackerCollector(tracker, clock or time.monotonic))
        self._requests: dict[tuple[str, str, str], Counter] = {}
        self._decisions: dict[tuple[str, str, str], Counter] = {}
        self._shadow: dict[tuple[str, str, bool], Counter] = {}
        self._ratio: dict[tuple[str, str], Histogram] = {}
        self._pool: dict[str, tuple[Histogram, Histogram, Counter, Histogram]] = {}

    def _declare_routing(self, r: CollectorRegistry) -> None:
        """Where requests went and how they ended: counters."""
        self.requests = Counter(
            "specroute_requests",
            "Routed requests by pool, backend and outcome status (ok|error|timeout|client_closed|"
            "client_error; client_error: the backend answered 4xx, the client's mistake).",
            ["pool", "backend", "status"],
            registry=r,
        )
        self.decisions = Counter(
            "specroute_decisions",
            "Routing decisions by policy, pool and reason.",
            ["policy", "pool", "reason"],
            registry=r,
        )
        self.rejected = Counter(
            "specroute_rejected_requests",
            "Requests answered by specroute itself before reaching a backend, by HTTP status.",
            ["code"],
            registry=r,
        )
        self.profile_mismatches = Counter(
            "specroute_profile_mismatches",
            "Times a policy found its speed profile off by more than 2x for a pool and rebased it.",
            ["policy", "pool"],
            registry=r,
        )
        self.failovers = Counter(
            "specroute_failovers",
            "Requests retried on another backend before their first byte, by the pool that failed.",
            ["pool"],
            registry=r,
        )
        self.ejections = Counter(
            "specroute_backend_ejections",
            "Times the outlier detector ejected a backend after consecutive failures.",
            ["pool", "backend"],
            registry=r,
        )
        self.client_stalls = Counter(
            "specroute_client_write_timeouts",
            "Answers given up because a write to the client stayed blocked for client_write_timeout_s.",
            registry=r,
        )
        self.shadow = Counter(
            "specroute_shadow_decisions",
            "Choices of the shadow policies, and whether they agree with the live policy's pool.",
            ["policy", "pool", "agrees"],
            registry=r,
        )

    def _declare_speeds(self, r: CollectorRegistry) -> None:
        """How fast answers came: latency and rate histograms, tokens."""
        self.ttft = Histogram(
            "specroute_ttft_seconds",
            "Time from the routing decision (request body read) to the first streamed event, per pool "
            "(streaming, ok requests).",
            ["pool"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "specroute_request_duration_seconds",
            "Time from the routing decision (request body read) to the end of the answer, per pool "
            "(ok requests).",
            ["pool"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.output_tokens = Counter(
            "specroute_output_tokens",
            "Completion tokens relayed, per pool (from the usage the backend reported).",
            ["pool"],
            registry=r,
        )
        self.decode_rate = Histogram(
            "specroute_decode_tokens_per_second",
            "Per-request decode rate after the first token, per pool (streaming, ok, >= 2 tokens).",
            ["pool"],
            buckets=DECODE_RATE_BUCKETS,
            registry=r,
        )
        self.prediction_ratio = Histogram(
            "specroute_prediction_ratio",
            "Actual / predicted end-to-end time of ok requests whose policy predicted the serving pool.",
            ["policy", "pool"],
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "specroute_proxy_overhead_seconds",
            "Time from request arrival to handing the request to the upstream connection.",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )

    def _declare_prefixes(self, r: CollectorRegistry) -> None:
        """What the prefix index believed against what the backends reported."""
        self.prefix_ratio = Histogram(
            "specroute_prefix_prediction_ratio",
            "Cached prompt tokens the prefix index predicted / what the backend reported, per pool (ok "
            "requests whose backend reported a non-zero cached_tokens).",
            ["pool"],
            buckets=PREFIX_RATIO_BUCKETS,
            registry=r,
        )
        self.prefix_false_hits = Counter(
            "specroute_prefix_false_hits",
            "Requests the prefix index believed partly cached on their backend that reported none.",
            ["pool"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specroute_prompt_tokens",
            "Prompt tokens of ok requests whose backend reports cached_tokens, per backend.",
            ["pool", "backend"],
            registry=r,
        )
        self.prefill_saved = Counter(
            "specroute_prefill_tokens_saved",
            "Prompt tokens the backend served from its prefix cache (not prefilled), per backend; "
            "hit ratio = rate(saved) / rate(specroute_prompt_tokens_total).",
            ["pool", "backend"],
            registry=r,
        )

    def request_done(self, pool: str, backend: str, status: str) -> None:
        key = (pool, backend, status)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(pool, backend, status)
        child.inc()

    def decision(self, policy: str, pool: str, reason: str) -> None:
        key = (policy, pool, reason)
        child = self._decisions.get(key)
        if child is None:
            child = self._decisions[key] = self.decisions.labels(policy, pool, reason)
        child.inc()

    def shadow_decision(self, policy: str, pool: str, agrees: bool) -> None:
        key = (policy, pool, agrees)
        child = self._shadow.get(key)
        if child is None:
            child = self._shadow[key] = self.shadow.labels(policy, pool, "true" if agrees else "false")
        child.inc()

    def outcome(self, policy: str, outcome: Outcome) -> None:
        """Latency, tokens, decode rate and prediction ratio of a finished request."""
        if outcome.status != "ok":
            return
        pool = outcome.decision.pool
        children = self._pool.get(pool)
        if children is None:
            children = self._pool[pool] = (
                self.ttft.labels(pool),
                self.duration.labels(pool),
                self.output_tokens.labels(pool),
                self.decode_rate.labels(pool),
            )
        ttft, duration, tokens, rate = children
        duration.observe(outcome.duration_s)
        if outcome.ttft_s is not None:
            ttft.observe(outcome.ttft_s)
        if outcome.completion_tokens:
            tokens.inc(outcome.completion_tokens)
            decode = outcome.decode_tok_s
            if decode is not None:
                rate.observe(decode)
        predicted = outcome.decision.predicted_e2e_s.get(pool)
        if predicted is not None and 0 < predicted < math.inf:
            key = (policy, pool)
            ratio = self._ratio.get(key)
            if ratio is None:
                ratio = self._ratio[key] = self.prediction_ratio.labels(policy, pool)
            ratio.observe(outcome.duration_s / predicted)

    def prefix_outcome(
        self, pool: str, backend: str, predicted: int, reported: int, prompt_tokens: int | None
    ) -> None:
        """What the prefix index believed cached on the serving backend against what it reported."""
        if reported > 0:
            self.prefix_ratio.labels(pool).observe(predicted / reported)
        elif predicted > 0:
            self.prefix_false_hits.labels(pool).inc()
        self.prefill_saved.labels(pool, backend).inc(reported)
        if prompt_tokens is not None:
            self.prompt_tokens.labels(pool, backend).inc(prompt_tokens)

    def proxy_overhead(self, seconds: float) -> None:
        self.overhead.observe(seconds)

    def reject(self, code: int) -> None:
        self.rejected.labels(str(code)).inc()

    def failover(self, pool: str) -> None:
        self.failovers.labels(pool).inc()

    def ejection(self, pool: str, backend: str) -> None:
        self.ejections.labels(pool, backend).inc()
