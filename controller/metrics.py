"""Prometheus metrics of the proxy, on a `CollectorRegistry` passed in (never the global one).

In-flight and health gauges are not incremented/decremented on the hot path: a collector reads
them from the `LoadTracker` at scrape time, so they are exactly the tracker's state. Counters
cache their labelled children so a request costs a dict lookup and an `inc()`.
Further metrics (TTFT, durations, tokens, prediction ratio, overhead) belong in this class too.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.load import LoadTracker


class _TrackerCollector(Collector):
    def __init__(self, tracker: LoadTracker) -> None:
        self._tracker = tracker

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "specroute_in_flight_requests",
            "Requests this proxy has in flight, per backend.",
            labels=["pool", "backend"],
        )
        healthy = GaugeMetricFamily(
            "specroute_backend_healthy", "1 when the backend is healthy, else 0.", labels=["pool", "backend"]
        )
        for b in self._tracker:
            in_flight.add_metric([b.pool, b.name], b.in_flight)
            healthy.add_metric([b.pool, b.name], 1.0 if b.healthy else 0.0)
        yield in_flight
        yield healthy


class Metrics:
    def __init__(self, registry: CollectorRegistry, tracker: LoadTracker) -> None:
        self.registry = registry
        self.requests = Counter(
            "specroute_requests",
            "Routed requests by pool, backend and outcome status (ok|error|timeout|client_closed).",
            ["pool", "backend", "status"],
            registry=registry,
        )
        self.decisions = Counter(
            "specroute_decisions",
            "Routing decisions by policy, pool and reason.",
            ["policy", "pool", "reason"],
            registry=registry,
        )
        self.rejected = Counter(
            "specroute_rejected_requests",
            "Requests answered by specroute itself before reaching a backend, by HTTP status.",
            ["code"],
            registry=registry,
        )
        self.failovers = Counter(
            "specroute_failovers",
            "Requests retried on another backend before their first byte, by the pool that failed.",
            ["pool"],
            registry=registry,
        )
        registry.register(_TrackerCollector(tracker))
        self._requests: dict[tuple[str, str, str], Counter] = {}
        self._decisions: dict[tuple[str, str, str], Counter] = {}

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

    def reject(self, code: int) -> None:
        self.rejected.labels(str(code)).inc()

    def failover(self, pool: str) -> None:
        self.failovers.labels(pool).inc()
