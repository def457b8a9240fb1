"""Backend-reported load: parse SGLang's `/metrics` and `/v1/loads` into one `BackendSample`.

How it works: SGLang exports scheduler gauges per rank (`tp_rank`, `pp_rank`, `moe_ep_rank`,
`dp_rank`, ...). Data-parallel ranks run separate schedulers, so their requests add up; the
tensor/pipeline/expert ranks of one scheduler report copies of the same state (recent releases
report only from rank 0), so within one data-parallel rank we take the largest value rather
than the sum, which is the same as the sum whenever only one rank reports. `/v1/loads` is
refreshed more often than `/metrics` (every 15 decode steps instead of 40), so where both
answer, running/queued come from `/v1/loads`. Parsing uses `prometheus_client.parser`, never
regexes. The functions here are pure; `BackendScraper` does the HTTP and `ScrapeLoop` runs it
for every backend in the background, storing samples in the `LoadTracker`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from controller.proxy.limits import read_bounded
from controller.proxy.load import LoadTracker
from policies.base import Pool

log = logging.getLogger("specroute.scrape")

SCRAPE_LIMIT_BYTES = 8 * 1024 * 1024
"""Largest /metrics or /v1/loads answer read (SGLang's are tens of kB)."""

RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
ACCEPT_LENGTH = "sglang:spec_accept_length"
GEN_THROUGHPUT = "sglang:gen_throughput"
_WANTED = frozenset((RUNNING, QUEUED, ACCEPT_LENGTH, GEN_THROUGHPUT))
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


def _scheduler_key(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in _REPLICA_LABELS))


def _aggregate(samples: Iterable[tuple[Mapping[str, str], float]]) -> float | None:
    per_scheduler: dict[tuple[tuple[str, str], ...], float] = {}
    for labels, value in samples:
        key = _scheduler_key(labels)
        prev = per_scheduler.get(key)
        per_scheduler[key] = value if prev is None else max(prev, value)
    if not per_scheduler:
        return None
    return sum(per_scheduler.values())


def parse_sglang_metrics(text: str, taken_at: float) -> BackendSample | None:
    """Parse SGLang's Prometheus text; None when it has no scheduler gauges (or is garbage)."""
    found: dict[str, list[tuple[Mapping[str, str], float]]] = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            if family.name not in _WANTED:
                continue
            for s in family.samples:
                if s.name == family.name:
                    found[family.name].append((s.labels, float(s.value)))
    except (ValueError, TypeError, IndexError) as e:
        log.debug("unparseable metrics text: %s", e)
        return None
    running = _aggregate(found.get(RUNNING, ()))
    if running is None:
        return None
    queued = _aggregate(found.get(QUEUED, ())) or 0.0
    accept_values = [v for _, v in found.get(ACCEPT_LENGTH, ()) if v > 0]
    accept = sum(accept_values) / len(accept_values) if accept_values else None
    return BackendSample(
        running=running,
        queued=queued,
        taken_at=taken_at,
        accept_length=accept,
        gen_throughput=_aggregate(found.get(GEN_THROUGHPUT, ())),
        source="metrics",
    )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def parse_v1_loads(data: Any, taken_at: float) -> BackendSample | None:
    """Parse `GET /v1/loads` (`{"loads": [per rank...]}` or a bare list of ranks)."""
    ranks = data.get("loads") if isinstance(data, dict) else data
    if not isinstance(ranks, list) or not ranks:
        return None
    running = queued = 0.0
    throughput = 0.0
    accepts: list[float] = []
    seen = False
    for rank in ranks:
        if not isinstance(rank, dict):
            continue
        r = _number(rank.get("num_running_reqs"))
        if r is None:
            continue
        seen = True
        running += r
        queued += _number(rank.get("num_waiting_reqs")) or 0.0
        throughput += _number(rank.get("gen_throughput")) or 0.0
        spec = rank.get("speculative")
        if isinstance(spec, dict):
            a = _number(spec.get("accept_length"))
            if a is not None and a > 0:
                accepts.append(a)
    if not seen:
        return None
    return BackendSample(
        running=running,
        queued=queued,
        taken_at=taken_at,
        accept_length=sum(accepts) / len(accepts) if accepts else None,
        gen_throughput=throughput,
        source="loads",
    )


def merge_samples(metrics: BackendSample | None, loads: BackendSample | None) -> BackendSample | None:
    """Running/queued from `/v1/loads` (fresher), the rest filled in from `/metrics`."""
    if loads is None:
        return metrics
    if metrics is None:
        return loads
    return replace(
        loads,
        accept_length=loads.accept_length if loads.accept_length is not None else metrics.accept_length,
        gen_throughput=loads.gen_throughput or metrics.gen_throughput,
        source="loads+metrics",
    )


class BackendScraper:
    """Scrapes one backend. Remembers which endpoints answer so it stops asking the others
    (an endpoint that did not answer is asked again every `recheck_every` scrapes)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 2.0,
        headers: Mapping[str, str] | None = None,
        recheck_every: int = 60,
    ) -> None:
        self.url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = dict(headers or {})
        self.recheck_every = recheck_every
        self.has_metrics: bool | None = None
        self.has_loads: bool | None = None
        self._scrapes = 0

    async def _get(self, session: aiohttp.ClientSession, path: str) -> tuple[int, str]:
        async with session.get(
            self.url + path, timeout=self._timeout, headers=self._headers, allow_redirects=False
        ) as resp:
            return resp.status, (await read_bounded(resp, SCRAPE_LIMIT_BYTES)).decode(errors="replace")

    def _ask(self, known: bool | None) -> bool:
        return known is not False or self._scrapes % self.recheck_every == 0

    async def scrape(self, session: aiohttp.ClientSession, now: float) -> BackendSample | None:
        """One scrape; raises aiohttp/OS/timeout errors when the backend cannot be reached."""
        self._scrapes += 1
        metrics = loads = None
        if self._ask(self.has_metrics):
            status, text = await self._get(session, "/metrics")
            metrics = parse_sglang_metrics(text, now) if status == 200 else None
            self.has_metrics = metrics is not None
        if self._ask(self.has_loads):
            status, text = await self._get(session, "/v1/loads")
            if status == 200:
                try:
                    loads = parse_v1_loads(json.loads(text), now)
                except ValueError:
                    loads = None
            self.has_loads = loads is not None
        return merge_samples(metrics, loads)


class ScrapeLoop:
    """Background task: scrape every backend each `interval_s` and store the samples in the
    `LoadTracker`. One task per backend, so a slow backend never delays the others' samples.
    A backend that answers but exports no load signal is logged once (local counts only)."""

    def __init__(
        self,
        tracker: LoadTracker,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        clock: Callable[[], float],
        headers: Callable[[Pool], Mapping[str, str]] | None = None,
    ) -> None:
        self.tracker = tracker
        self.session = session
        self.interval_s = interval_s
        self.clock = clock
        self.scrapers = {
            b.name: BackendScraper(b.url, timeout_s=timeout_s, headers=headers(b.pool) if headers else None)
            for b in tracker
        }
        self.samples = 0
        """Samples stored so far (all backends)."""

    async def run(self) -> None:
        """Scrape until cancelled."""
        await asyncio.gather(*(self._backend(name) for name in self.scrapers))

    async def scrape_once(self, name: str) -> BackendSample | None:
        """Scrape one backend now and store the sample; None when there was none."""
        scraper = self.scrapers[name]
        state = self.tracker.get(name)
        taken_at, in_flight = self.clock(), state.in_flight
        try:
            sample = await scraper.scrape(self.session, taken_at)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.debug("scrape of %s failed: %s", name, type(e).__name__)
            return None
        if sample is not None:
            self.tracker.record_sample(
                name,
                sample.running,
                sample.queued,
                taken_at,
                in_flight,
                accept_length=sample.accept_length,
                gen_throughput=sample.gen_throughput,
            )
            self.samples += 1
        return sample

    async def _backend(self, name: str) -> None:
        scraper = self.scrapers[name]
        warned = False
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                sample = await self.scrape_once(name)
            except Exception:  # a bug here must not stop the scraping of this backend for good
                log.exception("scrape of %s failed", name)
                sample = None
            if sample is None and not warned and scraper.has_metrics is False and scraper.has_loads is False:
                warned = True
                log.warning(
                    "backend %s exports no load metrics (neither sglang:num_running_reqs on /metrics "
                    "nor /v1/loads; start SGLang with --enable-metrics): routing on this proxy's own "
                    "in-flight counts only",
                    name,
                )
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))
