"""Decision-log records: one JSON object per finished request.

The observer on the request path turns the finished `RequestRecord` into the record's plain
dict at once (`decision_record`: numbers, short strings) and queues it with its estimated size
(`record_bytes`) for the decision log's writer thread, which encodes and writes it. So what waits
for the disk is the compact record, not the request's `RequestInfo`, view and decisions, and the
queue is bounded in bytes (`decision_log_queue_bytes`). A number the view or the outcome holds
that is not finite is written as null, so whatever a backend reported, the record is written.
Fields (stable; `simulator/traces.py` replays `ts`, `prompt_tokens`, `max_tokens`,
`completion_tokens` and `hint` as a `specroute-log` trace):

    ts                 arrival, unix seconds
    endpoint, stream   "chat"|"completions"|"generate", the request's stream flag
    prompt_tokens      the proxy's estimate (characters / 4)
    max_tokens, hint   as the client sent them (hint: x-specroute-hint, validated)
    forced_pool        x-specroute-mode when honoured, else null
    load               per pool at decision time: in_flight, load, scraped (null without a
                       fresh sample), healthy/backends, accept_length (null when unknown)
    policy             the live policy's name
    pool, backend      where the request was served (after a failover: the second backend)
    reason             the policy's reason ("failover" after a failover)
    chosen_pool, chosen_backend   what the policy (or the client) chose first
    predicted_ttft_s, predicted_e2e_s   per pool, {} when the policy does not predict
    ttft_s             actual time to the first streamed event (null: non-streaming or none)
    completion_tokens  from the usage the backend reported (null when it reported none)
    believed_cached_tokens   the prompt tokens the prefix index believed cached on the
                       backend that served (0: none, or prefix tracking off)
    cached_tokens      the prompt tokens the backend reported cached (null when it did not say)
    duration_s, status, http_status
    sequences          the sequences the backend ran for it (n x prompts)
    client_blocked_s   seconds the relay waited on a client slower than the answer (over 5% of
                       duration_s: the outcome taught no policy, `policies.routing.teaches`)
    shadow             [{policy, pool, backend, reason, predicted_ttft_s, predicted_e2e_s}]
    accept_factor_predicted   the eagle speed factor the policy used for this request (its
                       content prediction, 1 = the profile's speed; null when it made none)
    accept_factor_reported    the request's accept length over the profile's, as the eagle
                       backend reported it (spec_details on); null without a report

Never the prompt or the answer text: `RequestRecord` does not carry them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.proxy.acceptance_metrics import reported_factor
from controller.proxy.decision_log import DecisionLog
from controller.proxy.ticket import RequestRecord, believed_cached_on
from policies.base import Decision, LoadView, PoolLoad


def _num(value: float | None, digits: int = 6) -> float | None:
    """`value` rounded; null when it is unknown or not finite (a pool ruled out, a backend's NaN)."""
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


def _times(values: Any) -> dict[str, float | None]:
    """Per-pool seconds (a non-finite prediction, a pool ruled out, is null)."""
    return {pool: _num(float(v)) for pool, v in values.items()}


def _pool_summary(pool: PoolLoad) -> dict[str, Any]:
    scraped: int | None = None
    accepts = []
    healthy = 0
    for b in pool.backends:
        healthy += b.admits  # as before the healthy/admits split: may take a request
        s = b.scraped
        if s is not None:
            scraped = s if scraped is None else scraped + s
        if b.accept_length is not None:
            accepts.append(b.accept_length)
    return {
        "in_flight": pool.in_flight,
        "load": pool.load,
        "scraped": scraped,
        "healthy": healthy,
        "backends": len(pool.backends),
        "accept_length": _num(sum(accepts) / len(accepts), 4) if accepts else None,
    }


def load_summary(view: LoadView) -> dict[str, Any]:
    return {"baseline": _pool_summary(view.baseline), "eagle": _pool_summary(view.eagle)}


def _shadow(label: str, d: Decision) -> dict[str, Any]:
    return {
        "policy": label,
        "pool": d.pool,
        "backend": d.backend,
        "reason": d.reason,
        "predicted_ttft_s": _times(d.predicted_ttft_s),
        "predicted_e2e_s": _times(d.predicted_e2e_s),
    }


def decision_record(item: tuple[RequestRecord, float]) -> dict[str, Any]:
    """The log line of a finished request; `item` is (record, arrival unix time)."""
    r, ts = item
    info, out, d = r.request, r.outcome, r.decision
    return {
        "ts": _num(ts),
        "endpoint": info.endpoint,
        "stream": info.stream,
        "prompt_tokens": info.prompt_tokens,
        "max_tokens": info.max_tokens,
        "hint": info.hint,
        "forced_pool": info.forced_pool,
        "load": load_summary(r.view),
        "policy": r.policy.name,
        "pool": d.pool,
        "backend": d.backend,
        "reason": d.reason,
        "chosen_pool": r.chosen.pool,
        "chosen_backend": r.chosen.backend,
        "predicted_ttft_s": _times(r.chosen.predicted_ttft_s),
        "predicted_e2e_s": _times(r.chosen.predicted_e2e_s),
        "ttft_s": _num(out.ttft_s),
        "completion_tokens": out.completion_tokens,
        "believed_cached_tokens": believed_cached_on(r.view, d),
        "cached_tokens": out.cached_tokens,
        "duration_s": _num(out.duration_s),
        "status": out.status,
        "http_status": r.http_status,
        "sequences": info.sequences,
        "client_blocked_s": _num(out.client_blocked_s),
        "shadow": [_shadow(s.label, s.decision) for s in r.shadow],
        "accept_factor_predicted": _factor(r.chosen.accept_factor),
        "accept_factor_reported": _factor(reported_factor(r.policy, out)),
    }


def _factor(value: float | None) -> float | None:
    return _num(value, 4)


RECORD_BYTES = 3072
"""What one queued record holds at most without shadows: its dict, the nested load and
prediction dicts, floats and a hint of 32 characters (the strings it names, pools, backends,
reasons, are shared; `tests/proxy/test_decision_log_bytes.py` measures it)."""
SHADOW_BYTES = 1024
"""What one shadow policy's entry adds."""


def record_bytes(record: dict[str, Any]) -> int:
    """The memory a queued `decision_record` holds, at most (`RECORD_BYTES`, `SHADOW_BYTES`)."""
    return RECORD_BYTES + SHADOW_BYTES * len(record["shadow"])


class DecisionLogger:
    """Request observer that queues each finished request's record for the decision log.

    On the event loop it builds the record's dict (`decision_record`) and queues it; the writer
    thread encodes and writes it. A record that cannot be built costs only itself (counted
    `unencodable`)."""

    def __init__(self, log: DecisionLog, clock: Callable[[], float]) -> None:
        self.log = log
        self.clock = clock

    def __call__(self, record: RequestRecord) -> None:
        arrived = record.arrived_at if record.arrived_at is not None else record.outcome.started_at
        try:
            line = decision_record((record, time.time() - (self.clock() - arrived)))
        except Exception as e:
            self.log.unencodable(e)
            return
        self.log.write(line, record_bytes(line))


def open_decision_log(path: str, clock: Callable[[], float], **kwargs: Any) -> DecisionLogger:
    """Open (append to) the decision log at `path`; raises OSError when it cannot be opened.
    `kwargs` go to `DecisionLog` (`on_drop=` counts dropped records, `max_queued_bytes=` bounds
    what waits for the disk)."""
    return DecisionLogger(DecisionLog(path, **kwargs), clock)


class DecisionLogCollector(Collector):
    """What the open decision logs hold waiting for the disk, at scrape time."""

    def __init__(self, logs: list[DecisionLogger]) -> None:
        self._logs = logs

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "specroute_decision_log_queued_bytes",
            "Bytes of decision-log records waiting for the disk now (bounded by decision_log_queue_bytes).",
            value=sum(d.log.queued_bytes for d in self._logs),
        )
