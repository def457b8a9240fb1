"""The view builder: from what is known of each backend to the `LoadView` a policy sees.

One pure builder for the proxy (`controller.proxy.load.LoadTracker.view`) and every simulated
router (`simulator.engine.replica_views`, `simulator.engine.dispatch`), so a rule that shapes what a
policy sees cannot differ between them:

- **Load.** A backend's load is the larger of this replica's in-flight count and the scraped
  running + queued (`BackendLoad.load`); a sample is combined with the traffic this replica
  sent and saw finish since it was taken (`policies.replicas.believed_counts`).
- **Staleness.** A sample older than `stale_after_s` (default `STALE_AFTER_S`, serve's
  `scrape_stale_after_s`) is ignored: the backend is seen through the in-flight counts alone.
- **Admission.** A backend at its in-flight bound, or in a pool at its bound, is `full`: it is
  still usable, but it does not admit (`BackendLoad.admits`), so policies and the routing core
  route around it.
- **Capacity.** The running-request cap a backend reports (`max_running`, None when it reports
  none) goes into the view as it is: policies predict queueing from it, else from the profile.
- **Prefix belief.** `cached_tokens` is the longest prefix of the request's block fingerprint
  in the router's `PrefixIndex` of that backend, in tokens, at most the request's prompt
  estimate (`believed_cached`); the index learns a prompt when the request is dispatched there
  (`dispatched`), in the step that takes the slot.

- **Reuse.** `BackendLoad` is an immutable value: a builder may hand the same one to several
  decisions while its facts are unchanged (`backend_load` with `LastLoads`, for the proxy; the
  simulator's one router rebuilds only the servers whose state changed).

Pure code: no I/O, no clock (the caller passes `now`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from policies.base import BackendLoad, LoadView, Pool, PoolLoad
from policies.prefix import DEFAULT_BLOCK_TOKENS, PrefixIndex
from policies.replicas import believed_counts

STALE_AFTER_S = 5.0
"""serve's `scrape_stale_after_s` default, and the simulated routers': older samples are ignored."""


class LastLoads:
    """Each backend's last `BackendLoad` and the facts it was built from, for a builder that makes
    a view per decision (the proxy passes one to `backend_load`). `BackendLoad` is an immutable
    value and `backend_load` a pure function of its arguments, of `now` only through a sample
    (its age and staleness), so the same facts give an equal value: a backend without a sample
    that nothing happened to since the last view keeps its value; one with a sample gets a new
    one each time (its age has changed)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: dict[str, tuple[tuple[object, ...], BackendLoad]] = {}


def backend_load(
    name: str,
    pool: Pool,
    in_flight: int,
    in_flight_tokens: int,
    *,
    now: float,
    usable: bool = True,
    full: bool = False,
    running: int | None = None,
    queued: int | None = None,
    sample_time: float | None = None,
    sample_in_flight: int | None = None,
    accept_length: float | None = None,
    stale_after_s: float = STALE_AFTER_S,
    replicas: float = 1.0,
    cached_tokens: int = 0,
    max_running: int | None = None,
    reuse: LastLoads | None = None,
) -> BackendLoad:
    """A backend's `BackendLoad` as one replica sees it at `now`: its own in-flight counts, and
    the last sample (taken at `sample_time`, when this replica had `sample_in_flight` requests
    there; None: the sample already counts them) corrected by `believed_counts`; a sample older
    than `stale_after_s` (or none) leaves `running` None (own in-flight counts only). With
    `reuse`, the value built last for `name` when every argument is the same (`LastLoads`)."""
    facts: tuple[object, ...] = ()
    if reuse is not None:
        facts = (
            pool, in_flight, in_flight_tokens, usable, full, running, queued, sample_time,
            sample_in_flight, accept_length, stale_after_s, replicas, cached_tokens, max_running,
            None if sample_time is None else now,
        )  # fmt: skip
        last = reuse.last.get(name)
        if last is not None and last[0] == facts:
            return last[1]
    if sample_time is None or running is None or now - sample_time > stale_after_s:
        made = BackendLoad(
            name, pool, usable, in_flight, in_flight_tokens, None, None, None, None, cached_tokens, full,
            max_running,
        )  # fmt: skip
    else:
        r, q = believed_counts(running, queued or 0, in_flight, sample_in_flight, replicas)
        made = BackendLoad(
            name, pool, usable, in_flight, in_flight_tokens, r, q, accept_length, now - sample_time,
            cached_tokens, full, max_running,
        )  # fmt: skip
    if reuse is not None:
        reuse.last[name] = (facts, made)
    return made


def true_load(
    name: str, pool: Pool, running: int, queued: int, in_flight_tokens: int, accept_length: float | None
) -> BackendLoad:
    """`backend_load` of a backend whose every request is this router's, sampled at this very
    instant (the simulator's perfect view): in flight = running + queued, sample age 0. The same
    value as `backend_load(..., running=running, queued=queued, sample_time=now)`, built in one
    step (the simulator builds millions)."""
    return BackendLoad(
        name, pool, True, running + queued, in_flight_tokens, running, queued, accept_length, 0.0
    )


def believed_cached(
    index: PrefixIndex | None,
    blocks: Sequence[int],
    prompt_tokens: int | None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> int:
    """Tokens of a prompt (fingerprint `blocks`) the router believes a backend holds: its index's
    matched prefix, at most `prompt_tokens` (the request's estimate; None: no cap)."""
    if index is None or not blocks:
        return 0
    hit = index.match(blocks) * block_tokens
    return hit if prompt_tokens is None or hit < prompt_tokens else prompt_tokens


def dispatched(index: PrefixIndex | None, blocks: Sequence[int]) -> None:
    """A request with fingerprint `blocks` was dispatched to the backend of `index`: from now on
    the router believes the backend holds it."""
    if index is not None and blocks:
        index.insert(blocks)


def load_view(loads: Iterable[BackendLoad]) -> LoadView:
    """The `LoadView` of `loads` (each pool's backends in the order given)."""
    base: list[BackendLoad] = []
    eagle: list[BackendLoad] = []
    for b in loads:
        (base if b.pool == "baseline" else eagle).append(b)
    return LoadView(PoolLoad("baseline", tuple(base)), PoolLoad("eagle", tuple(eagle)))
