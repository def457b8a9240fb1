"""`specroute bench --prefill`: the server's prefill rate and its prefix cache, measured.

How it works, one request at a time on an otherwise idle server (concurrency 1, one output
token each, so TTFT is queue-free prefill plus the fixed first-token cost):

- Prefill rate: for each prompt length, `repeats` *fresh* prompts (a random nonce at the very
  start, so no prefix is shared with anything sent before and nothing is cached). TTFT is
  regressed on the prompt tokens the server reports (`usage.prompt_tokens`) by least squares,
  `ttft = a + tokens / prefill_tok_s`; the slope's 95% t-interval gives the rate's interval.
- Cache effect: `repeats` times, a fresh prompt of the longest length is sent twice in a row;
  the first TTFT is cold, the second warm, and the second's `cached_tokens`
  (`usage.prompt_tokens_details`, SGLang's `--enable-cache-report`) says how much was reused.
- Capacity: `max_total_num_tokens` from `/v1/loads` or `/server_info` (SGLang's KV pool, which
  is the prefix cache's capacity), when the server says.

Prompt text is random words from a fixed vocabulary. How many characters make a token depends
on the tokenizer (1.5-2x apart between models), so a first probe prompt is sent and its
`usage.prompt_tokens` sets the characters per token for the rest; the fit uses what the server
counted for each prompt. Lengths that would not fit the model's context (`max_model_len` of
`/v1/models`, with room for the chat template and the output token) are replaced by fitting ones
(an eighth, a quarter and half of it). A request that fails is counted and its error kept (the
server's message, e.g. a 400 for a prompt too long), so "not measurable" says why.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from controller.bench.client import discover_context, one_request
from controller.bench.prompts import Endpoint
from policies.stats import Estimate, estimate, t95

DEFAULT_PREFILL_LENGTHS: tuple[int, ...] = (1000, 4000, 16000)
DEFAULT_PREFILL_REPEATS = 5
_WORDS = (
    "alpha", "bravo", "cargo", "delta", "ember", "flute", "grove", "harbor", "ivory", "jolly",
    "kayak", "lemon", "maple", "noble", "orbit", "pearl", "quartz", "raven", "solar", "tulip",
)  # fmt: skip


DEFAULT_CHARS_PER_TOKEN = 4.0
CONTEXT_MARGIN_TOKENS = 64
"""Tokens of a model's context left for the chat template and the output token."""
_PROBE_TOKENS = 200


def fresh_text(tokens: int, rng: random.Random, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> str:
    """About `tokens` tokens of random words, starting with a nonce no other prompt shares."""
    nonce = f"[{rng.getrandbits(64):016x}] "
    words = [nonce]
    chars = len(nonce)
    while chars < tokens * chars_per_token:
        w = rng.choice(_WORDS)
        words.append(w + " ")
        chars += len(w) + 1
    return "".join(words)


@dataclass
class PrefillResult:
    points: list[tuple[int, float]] = field(default_factory=list)
    """(prompt tokens the server counted, TTFT seconds) of every fresh, successful request."""
    prefill_tok_s: float | None = None
    """1 / the fitted slope; None when the slope is not positive (no measurable prefill)."""
    prefill_tok_s_low: float | None = None
    prefill_tok_s_high: float | None = None
    """95% interval of the rate (from the slope's t-interval)."""
    intercept_s: float | None = None
    cold_ttft_s: Estimate | None = None
    warm_ttft_s: Estimate | None = None
    cached_fraction: Estimate | None = None
    """Reported cached tokens / prompt tokens of the warm requests (None: never reported)."""
    cache_tokens: int | None = None
    errors: int = 0
    error_messages: list[str] = field(default_factory=list)
    """The distinct errors of the failed requests (the first few), as the server worded them."""
    requests: int = 0
    lengths: list[int] = field(default_factory=list)
    """The prompt lengths (tokens) asked for, after fitting them to the context."""
    context_tokens: int | None = None
    """The model's context (`max_model_len`), when the server reported it."""
    chars_per_token: float | None = None
    """Measured on the probe prompt (None: the probe failed, 4 assumed)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "points": [list(p) for p in self.points],
            "prefill_tok_s": self.prefill_tok_s,
            "prefill_tok_s_ci95": [self.prefill_tok_s_low, self.prefill_tok_s_high],
            "intercept_s": self.intercept_s,
            "cold_ttft_s": self.cold_ttft_s.to_json() if self.cold_ttft_s else None,
            "warm_ttft_s": self.warm_ttft_s.to_json() if self.warm_ttft_s else None,
            "cached_fraction": self.cached_fraction.to_json() if self.cached_fraction else None,
            "cache_tokens": self.cache_tokens,
            "errors": self.errors,
            "error_messages": self.error_messages,
            "requests": self.requests,
            "lengths": self.lengths,
            "context_tokens": self.context_tokens,
            "chars_per_token": self.chars_per_token,
        }

    def describe(self) -> str:
        parts = []
        if self.prefill_tok_s is not None:
            parts.append(
                f"prefill {self.prefill_tok_s:.0f} tok/s (95% {self.prefill_tok_s_low:.0f}.."
                f"{self.prefill_tok_s_high:.0f}, n={len(self.points)})"
            )
        elif self.errors and len(self.points) < 3:
            parts.append(
                f"prefill not measured: {self.errors} of {self.requests} requests failed "
                f"({'; '.join(self.error_messages) or 'no message'})"
            )
        else:
            parts.append(
                f"prefill not measurable (TTFT does not grow with prompt length, n={len(self.points)})"
            )
        if self.errors and len(self.points) >= 3:
            failed = "; ".join(self.error_messages)
            parts.append(f"{self.errors} of {self.requests} requests failed ({failed})")
        if self.cold_ttft_s and self.warm_ttft_s:
            parts.append(
                f"same prompt twice: TTFT {self.cold_ttft_s.mean:.3f} s cold, {self.warm_ttft_s.mean:.3f} s "
                f"warm (n={self.warm_ttft_s.n})"
            )
        if self.cached_fraction is not None:
            parts.append(f"{self.cached_fraction.mean:.0%} of the prompt reported cached")
        if self.cache_tokens is not None:
            parts.append(f"cache capacity {self.cache_tokens} tokens")
        return "; ".join(parts)


def fit_prefill(
    points: Sequence[tuple[int, float]],
) -> tuple[float | None, float | None, float | None, float | None]:
    """(rate, rate low, rate high, intercept) of `ttft = a + tokens / rate`, the rate's interval
    from the slope's 95% t-interval; Nones when that interval reaches 0 (TTFT does not
    measurably grow with the prompt) or there are fewer than 3 points or 2 distinct lengths."""
    n = len(points)
    if n < 3 or len({x for x, _ in points}) < 2:
        return None, None, None, None
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    intercept = my - slope * mx
    ssr = sum((y - intercept - slope * x) ** 2 for x, y in points)
    half = t95(n - 2) * math.sqrt(ssr / (n - 2) / sxx)
    if slope - half <= 0:
        return None, None, None, intercept  # no slope distinguishable from none: no rate
    return 1 / slope, 1 / (slope + half), 1 / (slope - half), intercept


def fit_lengths(lengths: Sequence[int], context: int | None) -> tuple[int, ...]:
    """`lengths` that fit a context of `context` tokens (with `CONTEXT_MARGIN_TOKENS` to spare);
    when fewer than two do, an eighth, a quarter and half of the usable context instead."""
    if context is None:
        return tuple(lengths)
    usable = context - CONTEXT_MARGIN_TOKENS
    fitting = tuple(n for n in lengths if n <= usable)
    if len(set(fitting)) >= 2:
        return fitting
    return tuple(sorted({max(1, usable // 8), max(1, usable // 4), max(1, usable // 2)}))


async def _capacity(session: aiohttp.ClientSession, base: str) -> int | None:
    for path in ("/v1/loads", "/server_info", "/get_server_info"):
        try:
            async with session.get(base + path, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                data = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        candidates = [data, data.get("scheduler_info")]
        loads = data.get("loads")
        if isinstance(loads, list) and loads:
            candidates.insert(0, loads[0])
        for c in candidates:
            value = c.get("max_total_num_tokens") if isinstance(c, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


async def measure_prefill(
    session: aiohttp.ClientSession,
    base: str,
    model: str,
    *,
    endpoint: Endpoint = "chat",
    lengths: Sequence[int] = DEFAULT_PREFILL_LENGTHS,
    repeats: int = DEFAULT_PREFILL_REPEATS,
    timeout_s: float = 600.0,
    seed: int | None = None,
) -> PrefillResult:
    """Run the measurement (see the module's opening) against the server at `base`."""
    rng = random.Random(seed)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    url = base + path
    result = PrefillResult()
    t0 = time.perf_counter()

    async def send(text: str) -> tuple[int, float, int | None] | None:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": 1,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body.update(
            {"messages": [{"role": "user", "content": text}]} if endpoint == "chat" else {"prompt": text}
        )
        r = await one_request(session, url, body, endpoint, "measured", t0, timeout_s)
        result.requests += 1
        if not r.ok or r.ttft_s is None or r.prompt_tokens is None:
            result.errors += 1
            message = r.error or "no prompt_tokens in the usage"
            if message not in result.error_messages and len(result.error_messages) < 3:
                result.error_messages.append(message)
            return None
        return r.prompt_tokens, r.ttft_s, r.cached_tokens

    result.context_tokens = await discover_context(session, base)
    lengths = fit_lengths(lengths, result.context_tokens)
    result.lengths = list(lengths)
    chars = DEFAULT_CHARS_PER_TOKEN
    probe_text = fresh_text(_PROBE_TOKENS, rng)
    probe = await send(probe_text)  # also warms the server up: not a point of the fit
    if probe is not None and probe[0] > 0:
        chars = result.chars_per_token = round(len(probe_text) / probe[0], 3)

    for length in lengths:
        for _ in range(repeats):
            got = await send(fresh_text(length, rng, chars))
            if got is not None:
                result.points.append((got[0], got[1]))
    rate, low, high, intercept = fit_prefill(result.points)
    result.prefill_tok_s, result.prefill_tok_s_low, result.prefill_tok_s_high = rate, low, high
    result.intercept_s = intercept

    cold: list[float] = []
    warm: list[float] = []
    fractions: list[float] = []
    for _ in range(repeats):
        text = fresh_text(max(lengths), rng, chars)
        first = await send(text)
        second = await send(text)
        if first is None or second is None:
            continue
        cold.append(first[1])
        warm.append(second[1])
        if second[2] is not None:
            fractions.append(second[2] / second[0])
    result.cold_ttft_s, result.warm_ttft_s = estimate(cold), estimate(warm)
    result.cached_fraction = estimate(fractions)
    result.cache_tokens = await _capacity(session, base)
    return result
