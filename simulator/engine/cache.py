"""The true prefix cache of a server, with RadixAttention's rules on whole blocks: the one model
the simulator's servers (`simulator.engine.server`) and the emulator (`simulator.emulator.cache`)
both run.

How it works. A prompt is a sequence of block ids (chained hashes: an id names its whole prefix,
as Mooncake's `hash_ids` do). A request that is admitted matches its leading blocks against
the cache (those tokens skip prefill), then *references* all its blocks while it runs: a
referenced block is never evicted. When it finishes, its blocks stay cached, unreferenced, in
least-recently-used order; when the cache holds more than `capacity_blocks`, unreferenced
blocks go, oldest first. Blocks are released deepest first, so a prefix's parent is always more
recent than its children and eviction takes leaves first, as RadixAttention's does. Blocks of
running requests may exceed the capacity for a while (SGLang would hold the request back
instead); nothing is evicted until they are released.

What a request reports (`cached_prompt_tokens`): its matched blocks in tokens, at most
`prompt_tokens - 1`: at least one prompt token is always computed (its logits give the first
output token), so a fully cached prompt reports `prompt_tokens - 1`, as SGLang does, and that
token's prefill is still done. A finished request's answer is cached as SGLang caches a
finished request's tokens (`insert`), when the caller knows its blocks: the emulator does (it
has the text); the simulator's workloads carry prompt blocks only, so there a follow-up turn
hits its predecessor's prompt, not its answer.

The router's belief is a separate `policies.prefix.PrefixIndex` (fed when a request is routed);
this is what the server really holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def cached_prompt_tokens(hit_blocks: int, block_tokens: int, prompt_tokens: int) -> int:
    """Prompt tokens served from the cache for a prompt whose first `hit_blocks` blocks are
    cached: at most `prompt_tokens - 1` (the last prompt token is always computed)."""
    hit = hit_blocks * block_tokens
    last = prompt_tokens - 1
    return hit if hit < last else (last if last > 0 else 0)


class BlockCache:
    """Blocks one server holds: referenced ones (with counts) and an LRU of unreferenced ones."""

    __slots__ = ("_free", "_held", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self._held: dict[int, int] = {}
        """Referenced block -> number of running requests referencing it."""
        self._free: OrderedDict[int, None] = OrderedDict()
        """Unreferenced cached blocks, least recently used first."""

    def __len__(self) -> int:
        return len(self._held) + len(self._free)

    def __contains__(self, block: int) -> bool:
        return block in self._held or block in self._free

    def match(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of `blocks` are cached (nothing is touched)."""
        held, free = self._held, self._free
        n = 0
        for b in blocks:
            if b not in held and b not in free:
                break
            n += 1
        return n

    def acquire(self, blocks: Sequence[int]) -> int:
        """A request starts: returns its cached leading blocks, then references all its blocks
        (the uncached ones are computed by its prefill and cached from now on)."""
        hit = self.match(blocks)
        held, free = self._held, self._free
        for b in blocks:
            count = held.get(b)
            if count is not None:
                held[b] = count + 1
            else:
                free.pop(b, None)
                held[b] = 1
        self._evict()
        return hit

    def release(self, blocks: Sequence[int]) -> None:
        """A request ended: its blocks stay cached, unreferenced, the first block most recent."""
        held, free = self._held, self._free
        for b in reversed(blocks):
            count = held[b]
            if count > 1:
                held[b] = count - 1
            else:
                del held[b]
                free[b] = None
        self._evict()

    def insert(self, blocks: Sequence[int]) -> None:
        """Cache `blocks` (a finished request's prompt and answer) without referencing them, the
        first block most recent; referenced blocks stay referenced."""
        held, free = self._held, self._free
        for b in reversed(blocks):
            if b in held:
                continue
            if b in free:
                free.move_to_end(b)
            else:
                free[b] = None
        self._evict()

    def referenced(self, block: int) -> bool:
        return block in self._held

    def flush(self) -> bool:
        """Empty the cache; False (nothing done) while any block is referenced."""
        if self._held:
            return False
        self._free.clear()
        return True

    def _evict(self) -> None:
        free = self._free
        excess = len(self._held) + len(free) - self.capacity_blocks
        while excess > 0 and free:
            free.popitem(last=False)
            excess -= 1
