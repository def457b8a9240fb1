"""Prometheus metrics of the emulator, with SGLang's names, labels and buckets.

Scheduler gauges (`sglang:num_running_reqs`, ...) carry SGLang's scheduler labels
(`model_name`, `engine_type`, `tp_rank`, `pp_rank`, `moe_ep_rank`) and change only when the
scheduler publishes stats (every prefill batch and every `stats_interval_steps` decode steps),
so they lag the way SGLang's do. Request-level counters and histograms carry `model_name`
and are updated as events happen. Durations are wall seconds (they include --time-scale).
Every emulator owns its registry; nothing is global.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from simulator.emulator.batching import EngineRequest, FinishReason, SchedulerStats

_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400,
)  # fmt: skip


class EmulatorMetrics:
    """Implements `EngineObserver`; `registry` is what `/metrics` renders."""

    def __init__(self, model_name: str, *, speculative: bool, registry: CollectorRegistry | None = None):
        # Long, and flat: one declaration per SGLang metric the emulator serves, nothing between.
        self.registry = registry if registry is not None else CollectorRegistry()
        self.speculative = speculative
        sched = {"model_name": model_name, "engine_type": "unified"}
        sched.update(tp_rank="0", pp_rank="0", moe_ep_rank="0")
        tok = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(sched), registry=r)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.max_total_num_tokens = gauge(
            "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."
        ).labels(**sched)
        self.spec_accept_length = gauge(
            "sglang:spec_accept_length", "The average acceptance length of speculative decoding."
        )
        self.spec_accept_rate = gauge(
            "sglang:spec_accept_rate", "The average acceptance rate of speculative decoding."
        )
        self.spec_num_steps = gauge(
            "sglang:spec_num_steps", "The number of speculative steps in use (adaptive: it changes)."
        )
        self.spec_num_draft_tokens = gauge(
            "sglang:spec_num_draft_tokens", "The number of speculative draft tokens in use."
        )
        self._gauges = [
            self.num_used_tokens.labels(**sched),
            self.num_running_reqs.labels(**sched),
            self.num_queue_reqs.labels(**sched),
            self.gen_throughput.labels(**sched),
            self.token_usage.labels(**sched),
            self.cache_hit_rate.labels(**sched),
            self.spec_accept_length.labels(**sched),
            self.spec_accept_rate.labels(**sched),
            self.spec_num_steps.labels(**sched),
            self.spec_num_draft_tokens.labels(**sched),
        ]
        for g in self._gauges:
            g.set(0)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(tok), registry=r)

        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.").labels(
            **tok
        )
        self.generation_tokens = counter(
            "sglang:generation_tokens", "Number of generation tokens processed."
        ).labels(**tok)
        self.cached_tokens = Counter(
            "sglang:cached_tokens",
            "The number of prompt tokens served from the prefix cache.",
            [*tok, "cache_source"],
            registry=r,
        ).labels(**tok, cache_source="device")
        self.num_requests = counter("sglang:num_requests", "Number of requests processed.").labels(**tok)
        self.num_aborted = counter("sglang:num_aborted_requests", "Number of requests aborted.").labels(**tok)
        self.spec_verify_calls = counter(
            "sglang:spec_verify_calls", "Number of speculative verify steps (per request)."
        ).labels(**tok)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, list(tok), registry=r, buckets=buckets)

        self.ttft = hist(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        ).labels(**tok)
        self.itl = hist(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS
        ).labels(**tok)
        self.e2e = hist(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            _E2E_BUCKETS,
        ).labels(**tok)
        self.queue_time = hist(
            "sglang:queue_time_seconds", "Histogram of queueing time in seconds.", _E2E_BUCKETS
        ).labels(**tok)
        self.http_requests_active = Gauge(
            "sglang:http_requests_active", "Number of active HTTP requests.", registry=r
        )

    # -- EngineObserver ------------------------------------------------------------------

    def on_admit(self, req: EngineRequest, queue_s: float) -> None:
        self.queue_time.observe(queue_s)
        self.prompt_tokens.inc(req.prompt_tokens)
        self.cached_tokens.inc(req.cached_tokens)

    def on_first_token(self, req: EngineRequest, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.generation_tokens.inc(1)

    def on_chunk(self, req: EngineRequest, n: int, interval_s: float) -> None:
        self.generation_tokens.inc(n)
        if n > 0:
            self.itl.observe(interval_s / n)  # SGLang divides a chunk's interval by its tokens
        if self.speculative:
            self.spec_verify_calls.inc()

    def on_finish(self, req: EngineRequest, reason: FinishReason, e2e_s: float) -> None:
        self.num_requests.inc()
        self.e2e.observe(e2e_s)
        if reason == "abort":
            self.num_aborted.inc()

    def on_stats(self, stats: SchedulerStats) -> None:
        used, running, queued, tput, usage, hit, acc_len, acc_rate, steps, drafts = self._gauges
        used.set(stats.num_used_tokens)
        running.set(stats.num_running_reqs)
        queued.set(stats.num_queue_reqs)
        tput.set(stats.gen_throughput)
        usage.set(stats.token_usage)
        hit.set(stats.cache_hit_rate)
        acc_len.set(stats.spec_accept_length)
        acc_rate.set(stats.spec_accept_rate)
        steps.set(stats.spec_num_steps)
        drafts.set(stats.spec_num_draft_tokens)
