"""What one replica sees of a backend it shares with other replicas: the combination rule.

How it works: a replica knows its own in-flight requests on a backend exactly, and the
backend's own running/queued counts as of the last scrape (which include every replica's
requests). Between scrapes the backend changes by what every replica dispatched and saw
finish; a replica sees only its own part of that: `in_flight - sample_in_flight`, the requests
it dispatched (+1) and saw finish (-1) since the sample. `believed_counts` adds that part to
the sample. The proxy (`controller.proxy.load`) and the simulator's routers
(`simulator.engine.replica_views`) both build their `BackendLoad` with `policies.view.backend_load`,
which applies it, so a simulated replica sees exactly what a live one would.

Herding: while a backend looks idle, every replica sends there until its next scrape, each
seeing only its own share of the rush. With `replicas` = R > 1 a replica assumes the others
act like it: its own net change since the sample, times R, estimates the whole change (the
arrivals are split evenly across replicas, so each sees about 1/R of them). The shared
truth stays the backends' own counters at every scrape; nothing is exchanged between
replicas.
"""

from __future__ import annotations


def corrected(running: int, queued: int, delta: int) -> tuple[int, int]:
    """Running/queued after `delta` requests joined (+) or left (-) since the sample.

    New requests count as running (the backend's capacity is not known here); leaving ones
    shrink the total, and the queue never exceeds the total.
    """
    total = max(0, running + queued + delta)
    queued = min(queued, total)
    return total - queued, queued


def believed_counts(
    running: int, queued: int, in_flight: int, sample_in_flight: int | None, replicas: float = 1.0
) -> tuple[int, int]:
    """A sample's running/queued corrected by this replica's traffic since (times `replicas`).

    `sample_in_flight` None means the sample already counts this replica's requests as they
    are now (no correction). The scaled change is rounded to the nearest request."""
    if sample_in_flight is None:
        return running, queued
    delta = in_flight - sample_in_flight
    if replicas != 1.0 and delta:
        delta = round(delta * replicas)
    return corrected(running, queued, delta)
