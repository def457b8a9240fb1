"""Prompt fingerprints for the per-backend prefix index, and the cached tokens backends report.

How it works: a request's prompt is rendered once to one canonical string (`prompt_text`) and
cut into chained block hashes (`policies.prefix.fingerprint`: 512-token blocks of 2,048
characters). The `LoadTracker` keeps a `policies.prefix.PrefixIndex` per backend (what it was
recently sent, bounded by its cache capacity, least recently used out): `view(now, blocks)`
puts each backend's matched prefix into `BackendLoad.cached_tokens`, and `reserve` / `move`
record the prompt on the backend that gets it, in the same synchronous step as the decision.
The index is a belief: the backend's real cache may have evicted more (other clients, other
replicas) or hold more (the answers, which the proxy does not hash); the ratio of the two is a
metric (`specroute_prefix_prediction_ratio`).

The canonical rendering is `policies.prefix`'s (`chat_text`, `ids_text`), which the emulator's
prefix cache uses too, so the proxy's blocks and the emulator's cache name the same text. Here
only the request's prompt is picked out: chat `messages`; completions `prompt`; `/generate`
`text`, else `input_ids`; a batch of one prompt counts as that prompt, a batch of several is not
tracked (no fingerprint).

Cost: one pass of blake2b over the prompt (`benchmarks/proxy_overhead.py` measures it); prompts
longer than `THREAD_FROM_CHARS` are hashed in a worker thread (blake2b releases the GIL on whole
blocks) so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any

from policies.base import EndpointKind
from policies.prefix import (
    CHARS_PER_TOKEN,
    DEFAULT_BLOCK_TOKENS,
    chat_text,
    fingerprint,
    ids_text,
)

BLOCK_TOKENS = DEFAULT_BLOCK_TOKENS
"""Tokens one index block stands for (its text is `BLOCK_TOKENS * CHARS_PER_TOKEN` characters)."""
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN
THREAD_FROM_CHARS = 1 << 20
"""Prompts of at least this many characters (about 256k tokens) are hashed off the event loop."""

_NUMBER = re.compile(rb"\s*:\s*(\d{1,15})(?![\d.eE])")
"""A count: at most 15 digits (a longer or fractional number is no count a backend reports)."""


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def _single_prompt(prompt: Any) -> str:
    """The canonical text of a completions `prompt` or `/generate` `text`/`input_ids`."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return prompt
    if _is_ids(prompt):
        return ids_text(prompt)
    return ""


def prompt_text(body: Mapping[str, Any], endpoint: EndpointKind) -> str:
    """The canonical text of the request's prompt ("" when there is none to track)."""
    if endpoint == "chat":
        return chat_text(body.get("messages"))
    if endpoint == "completions":
        return _single_prompt(body.get("prompt"))
    text = body.get("text")
    return _single_prompt(text if text is not None else body.get("input_ids"))


def _blocks(body: Mapping[str, Any], endpoint: EndpointKind) -> tuple[int, ...]:
    text = prompt_text(body, endpoint)
    return fingerprint(text, BLOCK_CHARS) if len(text) >= BLOCK_CHARS else ()


async def prompt_blocks(
    body: Mapping[str, Any], endpoint: EndpointKind, body_bytes: int = 0
) -> tuple[int, ...]:
    """The request's block fingerprint (empty: nothing to match or record). A body of at least
    `THREAD_FROM_CHARS` bytes (`body_bytes`) has its prompt rendered and hashed in a worker
    thread: rendering a huge prompt to one string would hold the event loop meanwhile."""
    if body_bytes >= THREAD_FROM_CHARS:
        return await asyncio.to_thread(_blocks, body, endpoint)
    text = prompt_text(body, endpoint)
    if len(text) < BLOCK_CHARS:
        return ()
    if len(text) >= THREAD_FROM_CHARS:
        return await asyncio.to_thread(fingerprint, text, BLOCK_CHARS)
    return fingerprint(text, BLOCK_CHARS)


def last_count(data: bytes, key: bytes) -> int | None:
    """The integer value of the last `"KEY": N` member in `data` (JSON text), or None (absent,
    or null). Searched from the end (`rfind`), so a long stream tail costs a scan, not a regex
    pass. String contents are JSON-escaped (`\\"`), so text inside an answer never matches."""
    quoted = b'"' + key + b'"'
    at = data.rfind(quoted)
    while at >= 0:
        m = _NUMBER.match(data, at + len(quoted))
        if m is not None:
            return int(m.group(1))
        at = data.rfind(quoted, 0, at)
    return None


def reported_cached_tokens(data: bytes) -> int | None:
    """The `cached_tokens` a backend reported (`usage.prompt_tokens_details` on the OpenAI routes
    with SGLang's `--enable-cache-report`, `meta_info` on `/generate`); None when absent or null."""
    return last_count(data, b"cached_tokens")


def reported_prompt_tokens(data: bytes) -> int | None:
    return last_count(data, b"prompt_tokens")
