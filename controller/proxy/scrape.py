"""Backend-reported load: scrape each backend's `/metrics` (and SGLang's `/v1/loads`) into one
`BackendSample`, without stalling the event loop.

How it works: what the names mean per engine (SGLang, vLLM) lives in `controller.proxy.engines`;
this module does the HTTP. A `/metrics` answer is read in chunks and filtered line by line as it
arrives: only the samples some engine's parser reads are kept (a few dozen lines of a 50 kB vLLM
answer), the rest is dropped unparsed, and the loop gets a turn after every chunk. A scrape stops
(no sample) past `SCRAPE_LIMIT_BYTES` read or `SCRAPE_BUDGET_S` of CPU spent filtering, so a
huge or hostile answer costs a bounded amount and the proxy's requests keep flowing meanwhile
(`benchmarks/scrape_stall.py` measures the longest stall). `/v1/loads` (SGLang, refreshed every
15 decode steps instead of 40) is small JSON, read up to `LOADS_LIMIT_BYTES`; where both answer,
running/queued come from it. An SGLang backend's running-request cap comes from `/server_info`
(`/get_server_info` on older releases: the scheduler's effective cap per data-parallel rank,
summed, else the `max_running_requests` launch argument), asked at its first scrape and every
`recheck_every` scrapes after (launch arguments change only with a restart); `/v1/loads`' cap
is the fallback. The same answer says whether the backend adapts its draft depth in-engine
(`--speculative-adaptive`: `policies.ladder.from_sglang_server_info`); a vLLM backend says so on
`/server_info?config_format=json` when it serves that route (`VLLM_SERVER_DEV_MODE=1`: its
`num_speculative_tokens_per_batch_size`), asked as rarely. A backend's engine is configured or
detected at its first scrape whose `/metrics` names one; `BackendScraper` then asks only that
engine's endpoints. `ScrapeLoop` runs a scraper per backend in the background and stores the
samples in the `LoadTracker`.
Numbers that are not finite or out of their range (`engines.check_sample`) are
not taken: each is counted per backend (`specroute_backend_rejected_values_total`) and the first
one of a backend is logged, never a traceback per scrape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import aiohttp
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.proxy.capacity import replica_bound
from controller.proxy.engines import (
    ENGINES,
    MAX_SAMPLE_VALUE,
    SGLANG,
    WANTED_SAMPLES,
    BackendSample,
    Engine,
    EngineSetting,
    Rejected,
    VllmCounters,
    check_sample,
    detect,
    parse_sglang_metrics,
    plausible,
    read_samples,
    server_info_cap,
    sglang_sample,
    vllm_sample,
)
from controller.proxy.limits import ResponseTooLarge, read_bounded
from controller.proxy.load import LoadTracker
from policies.base import Pool
from policies.ladder import Reported, from_sglang_server_info, from_vllm_server_info

__all__ = [
    "BackendSample",
    "BackendScraper",
    "ScrapeLoop",
    "merge_samples",
    "parse_sglang_metrics",
    "parse_v1_loads",
    "read_metric_lines",
]

log = logging.getLogger("specroute.scrape")

SCRAPE_LIMIT_BYTES = 8 * 1024 * 1024
"""Largest /metrics answer read (SGLang's and vLLM's are tens of kB)."""
LOADS_LIMIT_BYTES = 256 * 1024
"""Largest /v1/loads answer parsed (a few hundred bytes per data-parallel rank): JSON is parsed in
one call, so its size bounds the stall."""
INFO_LIMIT_BYTES = 256 * 1024
"""Largest /server_info answer parsed (its launch arguments are a few kB)."""
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
"""SGLang's server info route, and its name on older releases."""
VLLM_INFO_PATH = "/server_info?config_format=json"
"""vLLM's resolved configuration as JSON (a development route: served with VLLM_SERVER_DEV_MODE=1)."""
SCRAPE_BUDGET_S = 0.1
"""CPU seconds one scrape may spend filtering `/metrics` lines before it gives up."""
CHUNK_BYTES = 64 * 1024
"""Filtered between two turns of the loop (about a millisecond of work)."""

_WANTED_BYTES = frozenset(name.encode() for name in WANTED_SAMPLES)
_PREFIXES = tuple(e.prefix.encode() for e in ENGINES.values())
_MARKS = _PREFIXES + tuple(n for n in sorted(_WANTED_BYTES) if not n.startswith(_PREFIXES))
"""What a line worth a look starts with: an engine's prefix (every wanted name has one today), or a
wanted name without one."""


def _lines_starting(data: bytes, mark: bytes) -> Iterator[bytes]:
    """The lines of `data` (whole lines) that start with `mark`, found by `bytes.find` (a `memchr`
    scan): a large answer of other samples costs no Python step per line (a Python loop over the
    lines of a large answer would spend the whole filtering budget, and a MULTILINE regex more)."""
    at = 0 if data.startswith(mark) else -1
    if at < 0 and (found := data.find(b"\n" + mark)) >= 0:
        at = found + 1
    while at >= 0:
        end = data.find(b"\n", at)
        yield data[at:] if end < 0 else data[at:end]
        if end < 0:
            return
        found = data.find(b"\n" + mark, end)
        at = -1 if found < 0 else found + 1


class ScrapeBudgetExceeded(Exception):
    """A /metrics answer took more CPU to filter than `SCRAPE_BUDGET_S`."""


async def read_metric_lines(
    resp: aiohttp.ClientResponse,
    *,
    limit: int = SCRAPE_LIMIT_BYTES,
    budget_s: float = SCRAPE_BUDGET_S,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[str, set[str]]:
    """The sample lines of a `/metrics` answer that some engine reads, as text, and the engine
    prefixes seen on any sample name (for detection). Raises `ResponseTooLarge` past `limit` bytes
    and `ScrapeBudgetExceeded` past `budget_s` of filtering."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise ResponseTooLarge(f"answer of {declared} bytes declared, the limit is {limit}")
    kept: list[bytes] = []
    seen: set[bytes] = set()
    tail = b""
    size = 0
    spent = 0.0
    while True:
        chunk = await resp.content.read(chunk_bytes)
        started = time.thread_time()  # CPU time, not wall time: a busy machine fails no scrape
        if chunk:
            size += len(chunk)
            if size > limit:
                raise ResponseTooLarge(f"answer larger than {limit} bytes")
            data = tail + chunk
            cut = data.rfind(b"\n") + 1  # whole lines now, the rest with the next read
            data, tail = data[:cut], data[cut:]
        else:
            data, tail = tail, b""
        for mark in _MARKS:  # (HELP and TYPE lines start with "#": never looked at)
            for line in _lines_starting(data, mark):
                end = line.find(b"{")
                name = line[: end if end >= 0 else line.find(b" ")]
                if name in _WANTED_BYTES:
                    kept.append(line)
                elif mark in _PREFIXES:
                    seen.add(mark)
        spent += time.thread_time() - started
        if spent > budget_s:
            raise ScrapeBudgetExceeded(f"filtering took over {budget_s:g} s of CPU after {size} bytes")
        if not chunk:
            break
        await asyncio.sleep(0)  # a buffered body would otherwise be read in one go
    for line in kept:
        seen.add(line[: line.find(b":") + 1])
    text = b"\n".join(kept).decode(errors="replace") + "\n"
    return text, {p.decode(errors="replace") for p in seen}


def parse_v1_loads(data: Any, taken_at: float, rejected: Rejected | None = None) -> BackendSample | None:
    """Parse `GET /v1/loads` (`{"loads": [per rank...]}` or a bare list of ranks). A number that
    is not finite or is larger than `MAX_SAMPLE_VALUE` is not taken (counted in `rejected`)."""

    def _number(value: Any, name: str) -> float | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        if plausible(value, -MAX_SAMPLE_VALUE, MAX_SAMPLE_VALUE):
            return float(value)
        if rejected is not None:
            rejected["loads:" + name] += 1
        return None

    ranks = data.get("loads") if isinstance(data, dict) else data
    if not isinstance(ranks, list) or not ranks:
        return None
    running = queued = 0.0
    throughput = 0.0
    accepts: list[float] = []
    usage: list[float] = []
    cap = tokens = 0
    seen = False
    for rank in ranks:
        if not isinstance(rank, dict):
            continue
        r = _number(rank.get("num_running_reqs"), "num_running_reqs")
        if r is None:
            continue
        seen = True
        running += r
        queued += _number(rank.get("num_waiting_reqs"), "num_waiting_reqs") or 0.0
        throughput += _number(rank.get("gen_throughput"), "gen_throughput") or 0.0
        cap += int(_number(rank.get("max_running_requests"), "max_running_requests") or 0)
        tokens += int(_number(rank.get("max_total_num_tokens"), "max_total_num_tokens") or 0)
        if (u := _number(rank.get("token_usage"), "token_usage")) is not None:
            usage.append(u)
        spec = rank.get("speculative")
        if isinstance(spec, dict):
            a = _number(spec.get("accept_length"), "accept_length")
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
        engine="sglang",
        kv_usage=sum(usage) / len(usage) if usage else None,
        max_running=cap or None,
        cache_tokens=tokens or None,
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
        kv_usage=loads.kv_usage if loads.kv_usage is not None else metrics.kv_usage,
        cache_hit_rate=metrics.cache_hit_rate,
        source="loads+metrics",
    )


class BackendScraper:
    """Scrapes one backend. Remembers which endpoints answer so it stops asking the others
    (an endpoint that did not answer is asked again every `recheck_every` scrapes). `engine` is
    the configured engine ("auto": detected from the first `/metrics` that names one)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 2.0,
        headers: Mapping[str, str] | None = None,
        recheck_every: int = 60,
        engine: EngineSetting = "auto",
        budget_s: float = SCRAPE_BUDGET_S,
    ) -> None:
        self.url = url.rstrip("/")
        self.budget_s = budget_s
        """CPU seconds one `/metrics` answer may take to filter (`read_metric_lines`)."""
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = dict(headers or {})
        self.recheck_every = recheck_every
        self.configured = engine
        self.engine: Engine | None = None if engine == "auto" else ENGINES[engine]
        """The backend's engine: configured, or detected (None until then)."""
        self.has_metrics: bool | None = None
        self.has_loads: bool | None = (
            False if self.engine is not None and not self.engine.loads_route else None
        )
        self._counters: VllmCounters | None = None
        self._scrapes = 0
        self.capacity: int | None = None
        """The running-request cap `/server_info` reported (SGLang; None: not known)."""
        self.adaptive: Reported | None = None
        """What `/server_info` says about in-engine adaptive speculation (None: it says nothing)."""
        self._info_asked = False
        self.rejected: Rejected = Counter()
        """Values this backend reported that were not taken (not finite, or out of range), by name."""
        self._vllm_info: bool | None = None
        """Whether vLLM's `/server_info` answered (None: not asked yet)."""

    def _ask(self, known: bool | None) -> bool:
        return known is not False or self._scrapes % self.recheck_every == 0

    def _request(self, session: aiohttp.ClientSession, path: str) -> Any:
        return session.get(
            self.url + path, timeout=self._timeout, headers=self._headers, allow_redirects=False
        )

    async def _metrics(self, session: aiohttp.ClientSession, now: float) -> BackendSample | None:
        async with self._request(session, "/metrics") as resp:
            if resp.status != 200:
                return None
            try:
                text, prefixes = await read_metric_lines(resp, budget_s=self.budget_s)
            except (ResponseTooLarge, ScrapeBudgetExceeded) as e:
                log.debug("metrics of %s not read: %s", self.url, e)
                return None
        if self.engine is None:
            self.engine = detect(prefixes)
            if self.engine is not None and not self.engine.loads_route:
                self.has_loads = False
        found = read_samples(text, rejected=self.rejected)
        if found is None or self.engine is None:
            return None
        if self.engine is SGLANG:
            return sglang_sample(found, now)
        parsed = vllm_sample(found, now, self._counters)
        if parsed is None:
            return None
        sample, self._counters = parsed
        return sample

    async def _loads(self, session: aiohttp.ClientSession, now: float) -> BackendSample | None:
        async with self._request(session, "/v1/loads") as resp:
            if resp.status != 200:
                return None
            try:
                body = await read_bounded(resp, LOADS_LIMIT_BYTES)
                return parse_v1_loads(json.loads(body), now, self.rejected)
            except (ResponseTooLarge, ValueError, RecursionError):  # deep JSON: no sample, no traceback
                return None

    async def _info(self, session: aiohttp.ClientSession, paths: tuple[str, ...]) -> tuple[Any, bool]:
        """(the JSON of the first of `paths` that answers, None when none can be read now; whether
        one answered other than 404)."""
        try:
            for path in paths:
                async with self._request(session, path) as resp:
                    if resp.status == 404:
                        continue
                    if resp.status != 200:
                        return None, True
                    return json.loads(await read_bounded(resp, INFO_LIMIT_BYTES)), True
        except (aiohttp.ClientError, TimeoutError, ValueError, RecursionError) as e:
            log.debug("server info of %s not read: %s", self.url, type(e).__name__)
            return None, True
        return None, False

    async def _server_info(self, session: aiohttp.ClientSession) -> None:
        """Read SGLang's `/server_info` (or `/get_server_info`): its cap and its adaptation."""
        info, _ = await self._info(session, SERVER_INFO_PATHS)
        cap = server_info_cap(info)
        if cap is not None:
            self.capacity = cap
        reported = from_sglang_server_info(info)
        if reported is not None:
            self.adaptive = reported

    async def _vllm_server_info(self, session: aiohttp.ClientSession) -> None:
        """Read vLLM's `/server_info?config_format=json` for its adaptation, where it is served."""
        info, answered = await self._info(session, (VLLM_INFO_PATH,))
        self._vllm_info = answered
        reported = from_vllm_server_info(info)
        if reported is not None:
            self.adaptive = reported

    async def scrape(self, session: aiohttp.ClientSession, now: float) -> BackendSample | None:
        """One scrape; raises aiohttp/OS/timeout errors when the backend cannot be reached. The
        sample's `max_running` is `/server_info`'s cap when SGLang reports one there."""
        self._scrapes += 1
        metrics = loads = None
        if self._ask(self.has_metrics):
            before = self.rejected.total()
            metrics = await self._metrics(session, now)
            # values it reported and were not taken: it answers, so it is asked again next time
            self.has_metrics = metrics is not None or self.rejected.total() > before
        if self._ask(self.has_loads):
            before = self.rejected.total()
            loads = await self._loads(session, now)
            self.has_loads = loads is not None or self.rejected.total() > before
            if loads is not None and self.engine is None:
                self.engine = SGLANG
        due = self._scrapes % self.recheck_every == 0
        if self.engine is SGLANG:
            if not self._info_asked or due:
                self._info_asked = True
                await self._server_info(session)
        elif self.engine is not None and (self._vllm_info is None or due):
            await self._vllm_server_info(session)
        sample = merge_samples(metrics, loads)
        if sample is not None and self.capacity is not None:
            sample = replace(sample, max_running=self.capacity)
        if sample is None:
            return None
        sample, dropped = check_sample(sample)
        self.rejected.update(dropped)
        return sample


CapacityHook = Callable[[str, int], None]
"""Called with a backend's name and the running-request cap it reported, on every sample that has one."""
EngineHook = Callable[[str, Engine], None]
"""Called once per backend with the engine it was found (or configured) to run."""
AdaptiveHook = Callable[[str, Reported], None]
"""Called with a backend's name and what it reports about its in-engine adaptation, when that
changes (first report included)."""


class ScrapeLoop:
    """Background task: scrape every backend each `interval_s` and store the samples in the
    `LoadTracker`. One task per backend, so a slow backend never delays the others' samples.
    A backend that answers but exports no load signal is logged once (local counts only), naming
    the engine found. `latest` holds each backend's last sample (KV usage, cap, engine...)."""

    def __init__(
        self,
        tracker: LoadTracker,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        clock: Callable[[], float],
        headers: Callable[[Pool], Mapping[str, str]] | None = None,
        engines: Mapping[str, EngineSetting] | None = None,
        on_capacity: CapacityHook | None = None,
        on_engine: EngineHook | None = None,
        on_adaptive: AdaptiveHook | None = None,
    ) -> None:
        self.tracker = tracker
        self.session = session
        self.interval_s = interval_s
        self.clock = clock
        configured = engines or {}
        self.scrapers = {
            b.name: BackendScraper(
                b.url,
                timeout_s=timeout_s,
                headers=headers(b.pool) if headers else None,
                engine=configured.get(b.name, "auto"),
            )
            for b in tracker
        }
        self.on_capacity = on_capacity
        self.on_engine = on_engine
        self.on_adaptive = on_adaptive
        self._adaptive: dict[str, Reported] = {}
        self._announced: set[str] = set()
        self._rejecting: set[str] = set()
        self.latest: dict[str, BackendSample] = {}
        self.samples = 0
        """Samples stored so far (all backends)."""

    def engine(self, name: str) -> Engine | None:
        """The backend's engine, configured or detected (None: not known yet)."""
        return self.scrapers[name].engine

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
        if scraper.engine is not None and name not in self._announced:
            self._announced.add(name)
            how = "configured" if scraper.configured != "auto" else "detected from /metrics"
            log.info("backend %s runs %s (%s)", name, scraper.engine.label, how)
            if self.on_engine is not None:
                self.on_engine(name, scraper.engine)
        if sample is not None and not self.tracker.record_sample(
            name,
            sample.running,
            sample.queued,
            taken_at,
            in_flight,
            accept_length=sample.accept_length,
            gen_throughput=sample.gen_throughput,
        ):
            scraper.rejected["running"] += 1
            sample = None
        if sample is not None:
            self.latest[name] = sample
            self.samples += 1
        if scraper.rejected and name not in self._rejecting:
            self._rejecting.add(name)
            log.warning(
                "backend %s reports numbers specroute does not take (not finite, or out of range): %s; "
                "they are dropped and counted in specroute_backend_rejected_values_total (logged once)",
                name, ", ".join(sorted(scraper.rejected)),
            )  # fmt: skip
        cap = sample.max_running if sample is not None else scraper.capacity
        if cap is not None and self.on_capacity is not None:
            # every scrape, not only on a change: a config reload resets the bounds
            self.on_capacity(name, cap)
        reported = scraper.adaptive
        if reported is not None and _changed(self._adaptive.get(name), reported):
            self._adaptive[name] = reported
            if self.on_adaptive is not None:
                self.on_adaptive(name, reported)
        return sample

    def _warn_no_metrics(self, name: str, scraper: BackendScraper) -> None:
        engine = scraper.engine
        if engine is None:
            what = "it names no engine on /metrics (neither sglang: nor vllm: samples) nor serves /v1/loads"
            hint = "start SGLang with --enable-metrics, or check that vLLM's /metrics is reachable"
        else:
            found = "configured" if scraper.configured != "auto" else "detected"
            what = f"its engine is {engine.label} ({found}) but /metrics has none of its scheduler gauges"
            hint = engine.metrics_hint
        log.warning(
            "backend %s exports no load metrics (%s; %s): routing on this proxy's own in-flight counts only",
            name, what, hint,
        )  # fmt: skip

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
                self._warn_no_metrics(name, scraper)
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))


def _changed(before: Reported | None, now: Reported) -> bool:
    if before is None or before.note != now.note:
        return True
    if before.ladder is None or now.ladder is None:
        return before.ladder is not now.ladder
    return not before.ladder.same_depths(now.ladder)


def apply_reported_cap(
    tracker: LoadTracker,
    bounded: Callable[[Pool], bool],
    margin: float,
    name: str,
    cap: int,
    replicas: int = 1,
) -> int | None:
    """Backend `name` reports running `cap` requests at most: the view carries it (policies
    predict its queue from it), and its admission bound becomes this replica's share of it
    (`capacity.replica_bound`: the cap plus `margin`, over `replicas`) unless its pool's bound is
    set explicitly (`bounded(pool)`). Returns the new bound when it changed (None when left alone)."""
    backend = tracker.get(name)
    backend.max_running = cap
    if bounded(backend.pool):
        return None
    bound = replica_bound(cap, margin, replicas)
    if bound == backend.max_in_flight:
        return None
    log.info(
        "backend %s reports %d running requests at most: admission bound %d (was %s)%s",
        name, cap, bound, backend.max_in_flight if backend.max_in_flight is not None else "unbounded",
        f", this replica's share of {replicas}" if replicas > 1 else "",
    )  # fmt: skip
    backend.max_in_flight = bound
    return bound


class RejectedValuesCollector(Collector):
    """The numbers each backend reported that were not taken, at scrape time (`BackendScraper.
    rejected`): `specroute_backend_rejected_values_total{backend, value}`. `loop` gives the running
    `ScrapeLoop` (None before the app started)."""

    def __init__(self, loop: Callable[[], ScrapeLoop | None]) -> None:
        self._loop = loop

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "specroute_backend_rejected_values",
            "Numbers a backend reported on /metrics or /v1/loads that were not taken (NaN, Inf, or out of "
            "range), by backend and what they were; the backend's first is logged.",
            labels=["backend", "value"],
        )
        loop = self._loop()
        for name, scraper in (loop.scrapers if loop is not None else {}).items():
            for value, n in sorted(scraper.rejected.items()):
                family.add_metric([name, value], n)
        yield family
