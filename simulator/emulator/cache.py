"""The emulated server's prefix cache: RadixAttention as seen from outside, in fixed-size blocks.

How it works. A prompt is the chain of hashes of its `block_tokens`-token blocks of canonical
text (`policies.prefix.fingerprint` with `block_tokens * 4` characters per block: the emulator
counts four characters per token), so prompts with the same leading text share their leading
blocks and a hash names a whole prefix. A partial last block is never cached, as in a paged KV
cache. The cache holds at most `capacity_tokens // block_tokens` blocks.

- `admit(blocks)`: the request's longest cached prefix is a hit; every block of the prompt is
  then referenced (the rest is computed by this request's prefill and cached from now on) and
  touched deepest first, so each block is more recent than every block below it.
- `release(handle, blocks)`: the request ended; its references go, and the blocks of its whole
  sequence (prompt and output, the text a follow-up turn starts with) are cached, as SGLang
  caches a finished request's tokens.
- Eviction (to stay within capacity): least recently used *unreferenced* blocks first. A
  referenced block's ancestors are referenced too, and a block is more recent than its
  descendants, so the first unreferenced block in LRU order is always a leaf: leaves go first,
  as RadixAttention evicts. When every block is referenced the cache stays over capacity until
  requests end (the emulator does not bound admission by KV memory).

Pure bookkeeping: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import takewhile

from policies.prefix import CHARS_PER_TOKEN, fingerprint


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
        self._refs: OrderedDict[int, int] = OrderedDict()
        """block hash -> running requests referencing it; LRU order (oldest first)."""
        self.hit_tokens = 0
        """Lifetime prompt tokens served from the cache (what `cached_tokens` reported)."""
        self.prompt_tokens = 0
        """Lifetime prompt tokens of admitted requests."""

    # -- queries ---------------------------------------------------------------------------

    def blocks_of(self, text: str) -> tuple[int, ...]:
        """The block chain of a canonical prompt text."""
        return fingerprint(text, self.block_tokens * CHARS_PER_TOKEN)

    def __len__(self) -> int:
        return len(self._refs)

    @property
    def cached_tokens(self) -> int:
        """Tokens the cache holds (whole blocks)."""
        return len(self._refs) * self.block_tokens

    def match(self, blocks: Sequence[int]) -> int:
        """Leading blocks of `blocks` the cache holds (nothing is touched)."""
        return sum(1 for _ in takewhile(self._refs.__contains__, blocks))

    def referenced(self, block: int) -> bool:
        return self._refs.get(block, 0) > 0

    # -- requests --------------------------------------------------------------------------

    def admit(self, blocks: Sequence[int], prompt_tokens: int) -> tuple[int, CacheHandle]:
        """(cached tokens of this prompt, the handle to release when the request ends).

        At least one prompt token is always computed (its logits give the first output token),
        so a fully cached prompt reports `prompt_tokens - 1`, as SGLang does."""
        hit = self.match(blocks) * self.block_tokens
        cached = max(0, min(hit, prompt_tokens - 1))
        self.hit_tokens += cached
        self.prompt_tokens += max(0, prompt_tokens)
        if not self.capacity_blocks:
            return cached, CacheHandle(())
        held = tuple(blocks[: self.capacity_blocks])
        refs = self._refs
        for b in reversed(held):
            refs[b] = refs.get(b, 0) + 1
            refs.move_to_end(b)
        self._evict()
        return cached, CacheHandle(held)

    def release(self, handle: CacheHandle, sequence: Sequence[int] = ()) -> None:
        """The request ended: drop its references and cache the blocks of `sequence` (its
        prompt followed by its output; empty: cache nothing more)."""
        refs = self._refs
        for b in handle.blocks:
            n = refs.get(b)
            if n is not None:
                refs[b] = n - 1 if n > 0 else 0
        if self.capacity_blocks and sequence:
            for b in reversed(sequence[: self.capacity_blocks]):
                refs[b] = refs.get(b, 0)
                refs.move_to_end(b)
        self._evict()

    def flush(self) -> bool:
        """Empty the cache; False (nothing done) while any block is referenced."""
        if any(n > 0 for n in self._refs.values()):
            return False
        self._refs.clear()
        return True

    def _evict(self) -> None:
        refs = self._refs
        excess = len(refs) - self.capacity_blocks
        if excess <= 0:
            return
        victims = []
        for b, n in refs.items():  # oldest first; the first unreferenced ones are leaves
            if n == 0:
                victims.append(b)
                if len(victims) == excess:
                    break
        for b in victims:
            del refs[b]
