"""Outlier detection in the spirit of Envoy's: consecutive failures eject a backend for a while.

How it works: the forwarder reports every upstream attempt once its fate is known -- `failure`
(connection refused or not accepted in time, a 5xx other than 503, a stream that broke, a
protocol error: a bad first event, a stream that ended without `[DONE]`, an oversize answer) or
`success` (any other answer, a 4xx included: the client's mistake is no backend fault). What a
client can cause does not count, so no client can get a healthy backend ejected: SGLang's
queue-full (and 503/429) is overload, backed off in `controller.proxy.capacity`, never reported
here; a timeout (`timeout`) counts only when the backend is also slow for others -- it made no
progress (a first byte, an answer, a stream's end) for any request since the timed-out one was
sent -- because a long generation that outlasts a timeout is the request's size, not a fault.
`consecutive_failures` failures in a row eject the backend: `BackendState.ejected_until` is set,
and the tracker leaves it out of routing until then. The n-th ejection lasts `n x base_s`
(capped at `max_s`), where n counts the backend's ejections, less one for every `base_s` it has
since served without being ejected: a backend that keeps failing stays out longer and longer, one
that recovers is soon treated as new. An ejection that would leave more than
`max_ejected_percent` of its pool ejected at once is not made (one backend of a pool may always
be ejected; the other pool, and panic mode in `load.py`, cover a pool left empty).

Ejection ends by time only. Health probes are a separate signal with their own thresholds
(`controller.proxy.health`); a backend that answers its probe but fails its requests stays out
for its ejection time.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from controller.proxy.load import BackendState, LoadTracker

log = logging.getLogger("specroute.outlier")


@dataclass(slots=True)
class _Record:
    failures: int = 0
    """Consecutive failures since the last success."""
    ejections: int = 0
    """Ejection multiplier (decays while the backend serves)."""
    back_at: float | None = None
    """When the last ejection ended (for the decay)."""
    progress_at: float | None = None
    """When the backend last made progress for some request (a first byte, an answer)."""


class OutlierDetector:
    def __init__(
        self,
        tracker: LoadTracker,
        *,
        consecutive_failures: int = 3,
        base_s: float = 10.0,
        max_s: float = 300.0,
        max_ejected_percent: float = 50.0,
    ) -> None:
        self.tracker = tracker
        self.consecutive_failures = consecutive_failures
        self.base_s = base_s
        self.max_s = max_s
        self.max_ejected_percent = max_ejected_percent
        self._records = {name: _Record() for name in tracker.backends}
        self.ejections_total = 0
        """Ejections made so far (a metric reads it)."""

    def success(self, backend: BackendState, now: float | None = None) -> None:
        rec = self._records[backend.name]
        rec.failures = 0
        if now is not None:
            rec.progress_at = now

    def progress(self, backend: BackendState, now: float) -> None:
        """The backend sent a first byte or an answer: it is serving (timeouts of others are theirs)."""
        self._records[backend.name].progress_at = now

    def timeout(self, backend: BackendState, sent_at: float, now: float, why: str) -> bool:
        """A request sent at `sent_at` timed out on `backend`: a failure only if the backend made
        no progress for any request since; True when it ejected the backend."""
        progress = self._records[backend.name].progress_at
        if progress is not None and progress >= sent_at:
            log.info("backend %s: %s, but it served others meanwhile: not counted", backend.name, why)
            return False
        return self.failure(backend, now, why)

    def failure(self, backend: BackendState, now: float, why: str) -> bool:
        """Count a failed attempt; True when it ejected the backend."""
        rec = self._records[backend.name]
        rec.failures += 1
        if rec.failures < self.consecutive_failures or backend.ejected(now):
            return False
        if not self._may_eject(backend, now):
            log.warning(
                "backend %s failed %d times in a row (%s) but stays in: %g%% of pool %s is ejected already",
                backend.name, rec.failures, why, self.max_ejected_percent, backend.pool,
            )  # fmt: skip
            return False
        if rec.back_at is not None and rec.ejections:
            rec.ejections = max(0, rec.ejections - math.floor((now - rec.back_at) / self.base_s))
        rec.ejections += 1
        seconds = min(self.max_s, self.base_s * rec.ejections)
        backend.ejected_until = now + seconds
        rec.back_at = backend.ejected_until
        rec.failures = 0
        self.ejections_total += 1
        log.warning(
            "backend %s ejected for %g s (ejection %d in a row) after %d consecutive failures; last: %s",
            backend.name, seconds, rec.ejections, self.consecutive_failures, why,
        )  # fmt: skip
        return True

    def _may_eject(self, backend: BackendState, now: float) -> bool:
        pool = self.tracker.pool_backends(backend.pool)
        ejected = sum(1 for b in pool if b.ejected(now))
        allowed = max(1, math.floor(len(pool) * self.max_ejected_percent / 100))
        return ejected + 1 <= allowed
