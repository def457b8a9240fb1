"""The emulated server's prefix cache: the simulator's cache model over blocks of text.

How it works. A prompt is the chain of hashes of its `block_tokens`-token blocks of canonical
text (`policies.prefix.fingerprint` with `block_tokens * 4` characters per block: the emulator
counts four characters per token), so prompts with the same leading text share their leading
blocks and a hash names a whole prefix. A partial last block is never cached, as in a paged KV
cache. The cache holds at most `capacity_tokens // block_tokens` blocks.

The rules are `simulator.engine.cache.BlockCache`'s, the one true-cache model the simulated
servers run too (admission references a prompt's blocks and reports its matched prefix, at most
`prompt_tokens - 1`; a finished request's blocks stay cached, least recently used and
unreferenced ones go first, leaves before their parents). On top of it, this class counts what
it served (`hit_tokens`, `prompt_tokens`) and caches a finished request's answer: `release(handle,
sequence)` caches the blocks of its whole sequence (prompt and output, the text a follow-up turn
starts with), as SGLang caches a finished request's tokens.

Pure bookkeeping: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.prefix import CHARS_PER_TOKEN, fingerprint
from simulator.engine.cache import BlockCache, cached_prompt_tokens


@dataclass(frozen=True, slots=True)
class CacheHandle:
    """What a running request holds: the blocks it references."""

    blocks: tuple[int, ...]


class PrefixCache:
    """Block cache of one emulated server (see the module's opening)."""

    def __init__(self, block_tokens: int, capacity_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.block_tokens = block_tokens
        self.capacity_tokens = capacity_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._cache = BlockCache(self.capacity_blocks) if self.capacity_blocks else None
        self.hit_tokens = 0
        """Lifetime prompt tokens served from the cache (what `cached_tokens` reported)."""
        self.prompt_tokens = 0
        """Lifetime prompt tokens of admitted requests."""

    # -- queries ---------------------------------------------------------------------------

    def blocks_of(self, text: str) -> tuple[int, ...]:
        """The block chain of a canonical prompt text."""
        return fingerprint(text, self.block_tokens * CHARS_PER_TOKEN)

    def __len__(self) -> int:
        return 0 if self._cache is None else len(self._cache)

    @property
    def cached_tokens(self) -> int:
        """Tokens the cache holds (whole blocks)."""
        return len(self) * self.block_tokens

    def match(self, blocks: Sequence[int]) -> int:
        """Leading blocks of `blocks` the cache holds (nothing is touched)."""
        return 0 if self._cache is None else self._cache.match(blocks)

    def referenced(self, block: int) -> bool:
        return self._cache is not None and self._cache.referenced(block)

    # -- requests --------------------------------------------------------------------------

    def admit(self, blocks: Sequence[int], prompt_tokens: int) -> tuple[int, CacheHandle]:
        """(cached tokens of this prompt, the handle to release when the request ends).

        At least one prompt token is always computed (its logits give the first output token),
        so a fully cached prompt reports `prompt_tokens - 1`, as SGLang does."""
        self.prompt_tokens += max(0, prompt_tokens)
        if self._cache is None:
            return 0, CacheHandle(())
        cached = cached_prompt_tokens(self._cache.acquire(blocks), self.block_tokens, prompt_tokens)
        self.hit_tokens += cached
        return cached, CacheHandle(tuple(blocks))

    def release(self, handle: CacheHandle, sequence: Sequence[int] = ()) -> None:
        """The request ended: drop its references and cache the blocks of `sequence` (its
        prompt followed by its output; empty: cache nothing more)."""
        if self._cache is None:
            return
        self._cache.release(handle.blocks)
        if sequence:
            self._cache.insert(sequence)

    def flush(self) -> bool:
        """Empty the cache; False (nothing done) while any block is referenced."""
        return self._cache is None or self._cache.flush()
