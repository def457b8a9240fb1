"""The measurement client behind `specroute bench`: a closed-loop concurrency sweep against any
OpenAI-compatible server (SGLang, the emulator, specroute itself).

Python API (no side effects at import; the demo uses it)::

    result = await run_sweep(
        url,                        # "http://host:port" (a trailing /v1 is accepted)
        levels=(1, 2, 5),           # concurrency levels, in order
        requests_per_level=30,      # measured requests per level
        warmup=5,                   # warm-up requests per level, not counted
        max_tokens=200,
        prompts="coding",           # built-in set name, JSONL path, or a PromptSet
        endpoint="chat",            # or "completions"
        label=None, model=None,     # model: None = first id of GET /v1/models
        headers=None,               # extra headers on every request (x-specroute-mode, auth)
        temperature=0.0, ignore_eos=False, timeout_s=600.0,
        on_level=None,              # callback(LevelResult) as each level finishes
        progress=False,             # progress on stderr: a bar on a terminal, else lines
    )                               # -> BenchResult (controller.bench.result)

    result.levels[0].summary.decode_tok_s   # Estimate: n, mean, half_width (95%), p50/p90/p99
    result.to_profile("eagle")              # one-mode specroute.profile/v1 Profile
    result.write("run.json")                # what `specroute compare` reads

`BenchRunner(config).run()` is the same with the result object kept on the runner, so a
caller that is interrupted (Ctrl-C cancels the task) still has `BenchRunner.result` with the
levels already finished.

How a level runs: `c` workers each send one streaming request after another. Requests that
start before `warmup` requests have completed are warm-up; the next `requests_per_level`
starts are measured; after that, workers send filler requests until every measured request
has finished, so each measured request runs with `c` requests in flight. Fillers then run to
completion (no aborts), and their tokens count toward the level's total throughput. One request
is measured by `controller.bench.client.one_request`.

While a level runs, `controller.bench.progress.SweepProgress` shows where the sweep is
(measured requests done and started, requests in flight, ETA of the level and of the sweep),
and `controller.bench.queue_watch.QueueWatch` records the largest queue the server reported;
it lands in `metadata["backend_queue_max"]` ({concurrency: requests}, absent without metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp

from controller import specroute_version
from controller.bench.client import BenchError, base_url, discover_model, fetch_server_info, one_request
from controller.bench.prefill import DEFAULT_PREFILL_REPEATS, PrefillResult, measure_prefill
from controller.bench.progress import SweepProgress, level_point
from controller.bench.prompts import Endpoint, PromptSet, load_prompts
from controller.bench.queue_watch import QueueWatch
from controller.bench.result import (
    BenchResult,
    LevelResult,
    Phase,
    RequestResult,
    accept_length_between,
    summarize,
)

__all__ = ["DEFAULT_LEVELS", "BenchConfig", "BenchError", "BenchRunner", "run_sweep"]

DEFAULT_LEVELS: tuple[int, ...] = (1, 2, 5, 10, 30, 70, 100, 250)

LevelCallback = Callable[[LevelResult], None]


@dataclass(frozen=True)
class BenchConfig:
    url: str
    levels: tuple[int, ...] = DEFAULT_LEVELS
    requests_per_level: int = 30
    warmup: int = 5
    max_tokens: int = 200
    prompts: PromptSet | str = "coding"
    endpoint: Endpoint = "chat"
    label: str | None = None
    model: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0
    headers: Mapping[str, str] = field(default_factory=dict)
    prefill_lengths: tuple[int, ...] = ()
    """Prompt lengths (tokens) of the prefill measurement run before the sweep; empty: none."""
    prefill_repeats: int = DEFAULT_PREFILL_REPEATS

    def __post_init__(self) -> None:
        if not self.levels or any(c < 1 for c in self.levels):
            raise ValueError("concurrency levels must be integers >= 1")
        if len(set(self.levels)) != len(self.levels):
            raise ValueError(f"concurrency levels must be distinct, got {list(self.levels)}")
        if self.requests_per_level < 1:
            raise ValueError("requests per level must be >= 1")
        if self.warmup < 0:
            raise ValueError("warm-up requests must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not self.timeout_s > 0 or self.timeout_s == float("inf"):
            raise ValueError(
                f"the per-request timeout must be a positive number of seconds, got {self.timeout_s}"
            )
        if any(n < 1 for n in self.prefill_lengths) or self.prefill_repeats < 1:
            raise ValueError("prefill lengths and repeats must be >= 1")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {self.endpoint!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"URL must start with http:// or https://, got {self.url!r}")


CATEGORY_PROBE = 8
"""Requests per category of the counter probe (servers that send no per-request acceptance)."""


class BenchRunner:
    """Runs a sweep; `result` holds every finished level, also after an interruption."""

    def __init__(
        self, config: BenchConfig, on_level: LevelCallback | None = None, progress: bool = False
    ) -> None:
        self.config = config
        self.on_level = on_level
        self.progress = progress
        self.prompts = (
            config.prompts if isinstance(config.prompts, PromptSet) else load_prompts(config.prompts)
        )
        self.base = base_url(config.url)
        self.result = BenchResult(
            metadata={
                "url": config.url,
                "label": config.label or config.url,
                "endpoint": config.endpoint,
                "model": config.model,
                "prompt_set": self.prompts.name,
                "prompt_count": len(self.prompts),
                "levels": list(config.levels),
                "requests_per_level": config.requests_per_level,
                "warmup": config.warmup,
                "max_tokens": config.max_tokens,
                "temperature": config.temperature,
                "ignore_eos": config.ignore_eos,
                "started": datetime.now(UTC).isoformat(timespec="seconds"),
                "finished": None,
                "interrupted": False,
                "specroute_version": specroute_version(),
                "server_info": None,
            }
        )
        self._next_prompt = 0
        self.prefill: PrefillResult | None = None
        self.sweep = SweepProgress(
            config.levels,
            requests_per_level=config.requests_per_level,
            warmup=config.warmup,
            label=config.label,
            clock=time.perf_counter,
            enabled=progress,
        )
        """Where the sweep is and its ETA (also when `progress` is off: the estimates are kept)."""
        self.measuring = True
        """False once the running level's measured requests are all done (and between levels)."""
        self.keep_busy: Callable[[], bool] | None = None
        """While it returns True, a level whose measured requests are done keeps sending fillers
        (`bench --together`: until the other server's measured requests are done too)."""

    def _body(self, model: str) -> dict[str, Any]:
        c = self.config
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": c.max_tokens,
            "temperature": c.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if c.ignore_eos:
            body["ignore_eos"] = True
        if self.prompts.categorized:  # per-category acceptance: SGLang's details (vLLM ignores it)
            body["return_spec_tokens_details"] = True
        body.update(self.prompts.pick(self._next_prompt).body(c.endpoint))
        self._next_prompt += 1
        return body

    async def run(self) -> BenchResult:
        c = self.config
        connector = aiohttp.TCPConnector(limit=max(c.levels) + 4)
        async with aiohttp.ClientSession(connector=connector, headers=dict(c.headers)) as session:
            md = self.result.metadata
            discovered = await discover_model(session, self.base)
            model = c.model or discovered
            md["server_info"] = await fetch_server_info(session, self.base)
            md["model"] = model
            self.sweep.cap = md["server_info"].get("max_running_requests")
            if c.prefill_lengths:  # first, while the server is idle
                self.prefill = await measure_prefill(
                    session, self.base, model, endpoint=c.endpoint, lengths=c.prefill_lengths,
                    repeats=c.prefill_repeats, timeout_s=c.timeout_s,
                )  # fmt: skip
                md["prefill"] = self.prefill.to_json()
            self.sweep.sweep_started = time.perf_counter()
            for level in c.levels:
                lv = await self._run_level(session, level, model)
                self.result.levels.append(lv)
                if self.on_level is not None:
                    self.on_level(lv)
            # avg_spec_accept_length is a lifetime average: the value after the sweep covers it.
            end_info = await fetch_server_info(session, self.base)
            md["server_info_end"] = end_info  # vLLM: its counters, for the sweep's own accept length
            if end_info["avg_spec_accept_length"] is not None:
                md["server_info"]["avg_spec_accept_length"] = end_info["avg_spec_accept_length"]
            if self.prompts.categorized and not self._accept_lengths_seen() and end_info.get("spec_drafts"):
                # no per-request details, but counters (vLLM): per category from their deltas
                md["category_probe"] = await self._probe_categories(session, model)
            md["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
        return self.result

    def _url(self) -> str:
        """Where the requests go: the endpoint's OpenAI route."""
        return self.base + ("/v1/chat/completions" if self.config.endpoint == "chat" else "/v1/completions")

    def _accept_lengths_seen(self) -> bool:
        return any(r.accept_length is not None for lv in self.result.levels for r in lv.requests)

    async def _probe_categories(self, session: aiohttp.ClientSession, model: str) -> dict[str, list[float]]:
        """Per category, the accept length of each of `CATEGORY_PROBE` requests sent one at a time
        after the sweep: 1 + accepted / drafted tokens between the server's counters read just
        before and just after it (exact only while no one else uses the server)."""
        c = self.config
        by: dict[str, list[int]] = {}
        for i, prompt in enumerate(self.prompts.prompts):
            if prompt.category is not None:
                by.setdefault(prompt.category, []).append(i)
        out: dict[str, list[float]] = {}
        t0 = time.perf_counter()
        for category, indexes in sorted(by.items()):
            for k in range(CATEGORY_PROBE):
                self._next_prompt = indexes[k % len(indexes)]
                body = self._body(model)
                before = await fetch_server_info(session, self.base)
                r = await one_request(session, self._url(), body, c.endpoint, "measured", t0, c.timeout_s)
                accept = accept_length_between(before, await fetch_server_info(session, self.base))
                if r.ok and accept is not None:
                    out.setdefault(category, []).append(accept)
        return out

    async def _run_level(self, session: aiohttp.ClientSession, level: int, model: str) -> LevelResult:
        c = self.config
        url = self._url()
        n_target = c.requests_per_level
        completed = measured_started = measured_done = 0
        results: list[RequestResult] = []
        state = self.sweep.start_level(level)
        watch = QueueWatch(session, self.base)
        t0 = time.perf_counter()

        async def worker() -> None:
            nonlocal completed, measured_started, measured_done
            while True:
                phase: Phase
                if completed < c.warmup:
                    phase = "warmup"
                elif measured_started < n_target:
                    phase = "measured"
                    measured_started += 1
                elif measured_done < n_target or (self.keep_busy is not None and self.keep_busy()):
                    phase = "filler"
                else:
                    return
                key = id(asyncio.current_task())
                state.in_flight += 1
                state.starts[key] = time.perf_counter()
                if phase == "measured":
                    state.measured_started = measured_started
                    state.measured_starts[key] = time.perf_counter()
                prompt = self.prompts.pick(self._next_prompt)
                try:
                    r = await one_request(session, url, self._body(model), c.endpoint, phase, t0, c.timeout_s)
                finally:
                    state.in_flight -= 1
                    state.measured_starts.pop(key, None)
                    state.starts.pop(key, None)
                r.category = prompt.category
                results.append(r)
                state.finished.append(r)
                completed += 1
                if r.ok and r.e2e_s is not None:
                    state.e2e_sum_s += r.e2e_s
                    state.e2e_n += 1
                if phase == "measured":
                    measured_done += 1
                    state.measured_done = measured_done
                    self.measuring = measured_done < n_target
                elif phase == "warmup":
                    state.warmup_done += 1
                else:
                    state.fillers_done += 1
                self.sweep.tick()

        async def ticker() -> None:
            while True:  # progress moves while requests run, not only when one ends
                self.sweep.tick()
                await asyncio.sleep(0.5)

        side = [asyncio.create_task(ticker()), asyncio.create_task(watch.run())]
        self.measuring = True
        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(level):
                    tg.create_task(worker())
        except BaseException:
            self.sweep.end_level(None)  # interrupted: the bar goes, the estimates learn nothing
            raise
        finally:
            self.measuring = False
            for task in side:
                task.cancel()
            for task in side:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self.sweep.end_level(level_point(level, results))
        if watch.max_queued is not None:
            self.result.metadata.setdefault("backend_queue_max", {})[str(level)] = watch.max_queued
        results.sort(key=lambda r: r.start_s)
        return LevelResult(concurrency=level, requests=results, summary=summarize(level, results))


async def run_sweep(
    url: str,
    levels: Sequence[int] = DEFAULT_LEVELS,
    requests_per_level: int = 30,
    warmup: int = 5,
    max_tokens: int = 200,
    prompts: PromptSet | str = "coding",
    endpoint: Endpoint = "chat",
    *,
    label: str | None = None,
    model: str | None = None,
    headers: Mapping[str, str] | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    timeout_s: float = 600.0,
    on_level: LevelCallback | None = None,
    progress: bool = False,
) -> BenchResult:
    """Run a closed-loop sweep and return its results (see the module docstring)."""
    config = BenchConfig(
        url=url,
        levels=tuple(levels),
        requests_per_level=requests_per_level,
        warmup=warmup,
        max_tokens=max_tokens,
        prompts=prompts,
        endpoint=endpoint,
        label=label,
        model=model,
        temperature=temperature,
        ignore_eos=ignore_eos,
        timeout_s=timeout_s,
        headers=dict(headers or {}),
    )
    return await BenchRunner(config, on_level=on_level, progress=progress).run()
