"""Decision-log records: one JSON object per finished request, built off the event loop.

The observer on the request path only stamps the arrival's wall-clock time and queues the
(immutable) `RequestRecord`; `decision_record` turns it into plain data in the decision log's
writer thread. Fields (stable; `simulator/traces.py` replays `ts`, `prompt_tokens`,
`max_tokens`, `completion_tokens` and `hint` as a `specroute-log` trace):

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
from collections.abc import Callable
from typing import Any

from controller.proxy.acceptance_metrics import reported_factor
from controller.proxy.decision_log import DecisionLog
from controller.proxy.ticket import RequestRecord, believed_cached_on
from policies.base import Decision, LoadView, PoolLoad


def _times(values: Any) -> dict[str, float | None]:
    """Per-pool seconds; a non-finite prediction (a pool ruled out) becomes null."""
    return {pool: round(float(v), 6) if math.isfinite(v) else None for pool, v in values.items()}


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
        "accept_length": round(sum(accepts) / len(accepts), 4) if accepts else None,
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
        "ts": round(ts, 6),
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
        "ttft_s": None if out.ttft_s is None else round(out.ttft_s, 6),
        "completion_tokens": out.completion_tokens,
        "believed_cached_tokens": believed_cached_on(r.view, d),
        "cached_tokens": out.cached_tokens,
        "duration_s": round(out.duration_s, 6),
        "status": out.status,
        "http_status": r.http_status,
        "shadow": [_shadow(s.label, s.decision) for s in r.shadow],
        "accept_factor_predicted": _factor(r.chosen.accept_factor),
        "accept_factor_reported": _factor(reported_factor(r.policy, out)),
    }


def _factor(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 4)


class DecisionLogger:
    """Request observer that queues each finished request for the decision log.

    On the event loop it costs two clock reads and a queue put; the record is turned into
    JSON in the log's writer thread."""

    def __init__(self, log: DecisionLog, clock: Callable[[], float]) -> None:
        self.log = log
        self.clock = clock

    def __call__(self, record: RequestRecord) -> None:
        arrived = record.arrived_at if record.arrived_at is not None else record.outcome.started_at
        self.log.write((record, time.time() - (self.clock() - arrived)))


def open_decision_log(path: str, clock: Callable[[], float], **kwargs: Any) -> DecisionLogger:
    """Open (append to) the decision log at `path`; raises OSError when it cannot be opened.
    `kwargs` go to `DecisionLog` (`on_drop=` counts dropped records)."""
    return DecisionLogger(DecisionLog(path, transform=decision_record, **kwargs), clock)
