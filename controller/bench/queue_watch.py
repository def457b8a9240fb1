"""The server's own queue while a bench level runs: `GET /metrics` once a second.

SGLang (`--enable-metrics`) exports `sglang:num_queue_reqs`, the requests waiting for a slot in
its batch; specroute exports `specroute_backend_queued_requests` (its backends' queues) and
`specroute_admission_waiting_requests` (requests waiting in specroute itself). Any of them above
0 during a level means its requests queued: their decode rate, measured from the first token
on, says nothing of the wait before it. A server without these metrics gives None.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

QUEUE_METRICS = frozenset(
    {"sglang:num_queue_reqs", "specroute_backend_queued_requests", "specroute_admission_waiting_requests"}
)


def queued_requests(metrics_text: str) -> float | None:
    """Sum of the queue gauges in a Prometheus text page; None when it has none of them."""
    total: float | None = None
    with contextlib.suppress(ValueError):  # not Prometheus text: no queue signal
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                if sample.name in QUEUE_METRICS:
                    total = (total or 0.0) + sample.value
    return total


class QueueWatch:
    """Polls `base/metrics` every `interval_s` until stopped; `max_queued` is the largest queue seen."""

    def __init__(self, session: aiohttp.ClientSession, base: str, interval_s: float = 1.0) -> None:
        self.session = session
        self.url = base + "/metrics"
        self.interval_s = interval_s
        self.max_queued: float | None = None
        self.available = True

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.interval_s))
        while self.available:
            try:
                async with self.session.get(self.url, timeout=timeout) as resp:
                    text = await resp.text() if resp.status == 200 else ""
            except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
                text = ""
            queued = queued_requests(text)
            if queued is None and self.max_queued is None:
                self.available = False  # no queue metrics here: stop asking
                return
            if queued is not None:
                self.max_queued = max(queued, self.max_queued or 0.0)
            await asyncio.sleep(self.interval_s)
