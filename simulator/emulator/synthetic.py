"""The emulator's synthetic tokens: a fixed cycle of words with stable ids and made-up logprobs.

Output token `p` of every sample is `WORDS[p % len(WORDS)]` with id `FIRST_TOKEN_ID + p % len(WORDS)`,
so text, ids and counts always agree. Logprobs are deterministic, plausible numbers (the chosen
token is always the most likely one; alternatives are the next words of the cycle), not a
model's: they exist so that clients get SGLang's logprob shapes with correct lengths.
"""

from __future__ import annotations

WORDS: tuple[str, ...] = (" The", " emulated", " server", " writes", " these", " synthetic", " tokens")
WORDS += (",", " one", " per", " step", " of", " its", " batch", " schedule", ".")
FIRST_TOKEN_ID = 1000
"""Id of `WORDS[0]`; prompt tokens written as text get ids from the same cycle."""


def text(start: int, n: int) -> str:
    """Text of output tokens `start .. start + n - 1`."""
    return "".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def token_id(position: int) -> int:
    return FIRST_TOKEN_ID + position % len(WORDS)


def token_ids(start: int, n: int) -> list[int]:
    return [token_id(start + i) for i in range(n)]


def word(token: int) -> str:
    """The text of a token id (ids outside the cycle, e.g. a client's input_ids, map into it)."""
    return WORDS[(token - FIRST_TOKEN_ID) % len(WORDS)]


def logprob(position: int) -> float:
    """Logprob of the chosen token at output position `position` (between -0.02 and -1.0)."""
    return -round(0.02 + 0.98 * ((position * 37) % 50) / 49, 4)


def top_logprobs(position: int, k: int) -> list[tuple[float, int]]:
    """The `k` most likely tokens at `position` as (logprob, token id), the chosen one first;
    at most `len(WORDS)` (the emulator's whole vocabulary)."""
    chosen = logprob(position)
    k = min(k, len(WORDS))
    return [(chosen if j == 0 else round(chosen - 0.75 * j, 4), token_id(position + j)) for j in range(k)]
