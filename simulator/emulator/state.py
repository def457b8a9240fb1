"""The runtime state of one emulated server: its batch engine, metrics, live faults and the
output-length plan of each request."""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from typing import Any

from aiohttp import web

from policies.adaptive import AdaptiveSpeed, adaptive_mode
from policies.prefix import DEFAULT_CACHE_TOKENS
from policies.profile import SpeedModel
from simulator.emulator.adaptive import AdaptiveDrafting
from simulator.emulator.batching import BatchEngine, EngineRequest, Event
from simulator.emulator.cache import PrefixCache
from simulator.emulator.config import EmulatorConfig
from simulator.emulator.metrics import EmulatorMetrics
from simulator.emulator.prompt_text import sequence_text


class Emulator:
    """Runtime state of one emulated server (held in the app under `EMULATOR_KEY`)."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.faults = config.faults.model_copy()
        self.rng = random.Random(config.seed)
        self.metrics = EmulatorMetrics(config.model, speculative=config.mode == "eagle")
        self.started_at = time.time()
        self.cache: PrefixCache | None = None
        self._engine: BatchEngine | None = None

    @property
    def engine(self) -> BatchEngine:
        if self._engine is None:
            raise RuntimeError("the emulator app has not started")
        return self._engine

    async def start(self) -> None:
        c = self.config
        cache_tokens = c.effective_cache_tokens
        self.cache = PrefixCache(c.cache_block_tokens, cache_tokens) if cache_tokens else None
        speed = c.profile.speed(c.mode)
        adaptive = None
        if c.ladder is not None:
            base, eagle = c.profile.mode("baseline"), c.profile.mode("eagle")
            # TTFT and prefill of the settled ladder; each step's time from its own depth
            speed = SpeedModel(adaptive_mode(base, eagle, c.ladder))
            depths = AdaptiveSpeed(SpeedModel(base), SpeedModel(eagle), c.depth)
            adaptive = AdaptiveDrafting(c.ladder, depths, random.Random(c.seed + 2))
        self._engine = BatchEngine(
            speed,
            max_running_requests=c.effective_max_running,
            time_scale=c.time_scale,
            accept_length=c.effective_accept_length,
            speculative_num_steps=c.speculative_num_steps,
            stats_interval_steps=c.stats_interval_steps,
            seed=c.seed + 1,
            observer=self.metrics,
            # the cache is the KV pool (running requests' tokens live there too, unbounded here)
            max_total_num_tokens=cache_tokens or DEFAULT_CACHE_TOKENS,
            cache=self.cache,
            adaptive=adaptive,
        )
        self.metrics.max_total_num_tokens.set(self._engine.max_total_num_tokens)
        self._engine.start()

    async def stop(self) -> None:
        if self._engine is not None:
            await self._engine.stop()

    def plan_output(self, max_tokens: int | None, ignore_eos: bool, prompt_tokens: int) -> tuple[int, str]:
        """(tokens to generate, finish reason when they are done)."""
        c = self.config
        room = max(1, c.max_model_len - prompt_tokens)
        if ignore_eos and max_tokens is not None:
            return min(max_tokens, room), "length"
        natural = self._natural_length()
        if max_tokens is not None and natural >= max_tokens:
            return min(max_tokens, room), "length"
        if natural >= room:
            return room, "length"
        return natural, "length" if ignore_eos else "stop"

    def _natural_length(self) -> int:
        c = self.config
        if c.output_tokens_cv <= 0:
            return max(1, round(c.output_tokens_mean))
        sigma2 = math.log1p(c.output_tokens_cv**2)
        mu = math.log(c.output_tokens_mean) - sigma2 / 2
        return max(1, round(self.rng.lognormvariate(mu, math.sqrt(sigma2))))

    def new_request(
        self,
        rid: str | None,
        prompt_tokens: int,
        max_tokens: int | None,
        ignore_eos: bool,
        hint: str | None,
        *,
        events: asyncio.Queue[Event] | None = None,
        index: int = 0,
        text: str = "",
        chat: bool = False,
        ids_prompt: bool = False,
        temperature: float | None = None,
    ) -> EngineRequest:
        """An engine request with its output length drawn; the samples of one HTTP request pass
        the same `events` queue and their own `index`. `text` is the prompt's canonical text
        (`policies.prefix`; a chat prompt when `chat`, token ids when `ids_prompt`), which gives
        its prefix-cache blocks."""
        n, reason = self.plan_output(max_tokens, ignore_eos, prompt_tokens)
        accept = self.config.effective_accept_length or 1.0
        if hint is not None:
            accept *= self.config.hint_factors.get(hint, 1.0)
        rules = self.config.accept_rules
        if self.config.mode == "eagle" and (rules.rules or rules.temperature_slope):
            accept *= rules.factor(text, temperature)
        return EngineRequest(
            rid=rid or uuid.uuid4().hex,
            prompt_tokens=prompt_tokens,
            output_tokens=n,
            finish_reason="stop" if reason == "stop" else "length",
            accept_mean=accept,
            events=events if events is not None else asyncio.Queue(),
            index=index,
            **self._cache_fields(text, chat, ids_prompt),
        )

    def _cache_fields(self, text: str, chat: bool, ids_prompt: bool) -> dict[str, Any]:
        cache = self.cache
        if cache is None or not text:
            return {}

        def sequence_blocks(generated: int) -> tuple[int, ...]:
            return cache.blocks_of(sequence_text(chat, text, ids_prompt, generated))

        return {"blocks": cache.blocks_of(text), "sequence_blocks": sequence_blocks}


EMULATOR_KEY = web.AppKey("emulator", Emulator)
