"""Prompt fingerprints and an approximate per-backend prefix index (what a backend has cached).

How it works. SGLang's RadixAttention reuses the KV cache of a prompt's leading tokens when an
earlier request sent the same tokens. The proxy cannot see tokens or the backend's cache, so it
keeps an approximation:

- A prompt's *fingerprint* is the chain of hashes of its fixed-size blocks of canonical text:
  `h[i] = H(h[i-1], block[i])`. Two prompts share their first k hashes exactly when their first
  k blocks agree (up to hash collisions, 1 in 2^64), so a hash names a whole prefix. Only whole
  blocks are hashed: a partial last block never matches, as in a paged KV cache.
- A `PrefixIndex` per backend remembers the block hashes it was recently sent, bounded by the
  backend's cache capacity in blocks, least recently used first out. Inserting a prompt touches
  its blocks from the last to the first, so a parent block is always more recent than its
  children and eviction takes the deepest blocks first, as RadixAttention evicts leaves.
  `match` counts the leading blocks of a fingerprint the backend holds.

The simulator feeds the same index with Mooncake's `hash_ids` (already chained block hashes)
or with the block ids of its synthetic multi-turn workload, so policies see the same data in
the simulator as in the proxy. Pure code: no I/O, no clock.

The canonical text of a prompt is rendered here once, for both the proxy's index
(`controller.proxy.prefixes.prompt_text`) and the emulator's prefix cache
(`simulator.emulator.requests`), so the proxy's blocks and the emulator's cache name the same
text:

- chat: every message as `<|ROLE|>\\nTEXT\\n` in order (`chat_text`; TEXT: a string content,
  or the text parts of a list content joined); no generation prompt, so the next turn (these
  messages, the answer as an assistant message, a new user message) starts with it;
- completions / `/generate`: the prompt text as it is;
- token ids: four characters per id (`ids_text`), so blocks of ids hold as many tokens as
  blocks of text (four characters per token).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from hashlib import blake2b
from typing import Any

from policies.learned import check_version, field, pack, unpack

DEFAULT_BLOCK_TOKENS = 512
DEFAULT_CACHE_TOKENS = 1_000_000
"""A server's prefix-cache capacity in tokens when neither the config nor the profile gives one:
what the proxy's index assumes and the KV pool the emulator reports (`max_total_num_tokens`)."""
CHARS_PER_TOKEN = 4
"""The proxy's prompt-length estimate (characters / 4) also sizes its text blocks."""


def content_text(content: Any) -> str:
    """The text of a chat message's content: a string as it is, the text parts of a list joined,
    anything else ""."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def message_text(role: str, content: Any) -> str:
    """One chat message as `<|ROLE|>\\nTEXT\\n`."""
    return f"<|{role}|>\n{content_text(content)}\n"


def chat_text(messages: Any) -> str:
    """The messages in order (entries that are not objects are left out; not a list: "")."""
    if not isinstance(messages, list):
        return ""
    return "".join(
        message_text(str(m.get("role")), m.get("content")) for m in messages if isinstance(m, dict)
    )


def ids_text(ids: Iterable[int]) -> str:
    """Four characters per token id: its low 32 bits, big-endian, a byte per character."""
    return b"".join((t & 0xFFFFFFFF).to_bytes(4, "big") for t in ids).decode("latin-1")


def fingerprint(text: str, block_chars: int = DEFAULT_BLOCK_TOKENS * CHARS_PER_TOKEN) -> tuple[int, ...]:
    """Chained 64-bit hashes of the whole `block_chars`-character blocks of `text`.

    One pass of blake2b over the text (about 1 GB/s): a 100k-token prompt takes well under a
    millisecond. Deterministic across processes, so every replica fingerprints alike."""
    if block_chars < 1:
        raise ValueError("block_chars must be >= 1")
    data = text.encode("utf-8", errors="surrogatepass")
    # Blocks are cut in characters; encoded lengths differ per block for non-ASCII text, so cut
    # the string, not the bytes, unless it is all ASCII (the common case: one slice per block).
    ascii_only = len(data) == len(text)
    out: list[int] = []
    prev = b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        block = (
            data[start : start + block_chars]
            if ascii_only
            else text[start : start + block_chars].encode("utf-8", errors="surrogatepass")
        )
        prev = blake2b(prev + block, digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return tuple(out)


class PrefixIndex:
    """The block hashes one backend was recently sent, at most `capacity_blocks`, LRU out."""

    __slots__ = ("_blocks", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def match(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of `blocks` this backend holds (a query: nothing is touched)."""
        held = self._blocks
        n = 0
        for b in blocks:
            if b not in held:
                break
            n += 1
        return n

    def insert(self, blocks: Sequence[int]) -> None:
        """Record that the backend was sent `blocks` (it now caches them), evicting the least
        recently used blocks beyond the capacity."""
        if not self.capacity_blocks:
            return
        held = self._blocks
        # Deepest first, so that each block ends up more recent than the blocks below it.
        for b in reversed(blocks[: self.capacity_blocks]):
            if b in held:
                held.move_to_end(b)
            else:
                held[b] = None
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()

    # What it believes, as plain data (`policies.learned`): the block hashes, least recently
    # used first. Loaded into an index of another capacity, the most recent ones that fit stay.

    def state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "blocks": pack(list(self._blocks), "<u8")}

    def load_state(self, state: object) -> None:
        what = "prefix index"
        blocks = unpack(field(check_version(state, what, STATE_VERSION), "blocks", what), "<u8", what)
        kept = blocks[len(blocks) - self.capacity_blocks :] if self.capacity_blocks else []
        self._blocks = OrderedDict.fromkeys(kept)


STATE_VERSION = 1
"""The layout of `PrefixIndex.state()`."""
