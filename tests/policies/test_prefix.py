"""Canonical prompt text, prompt fingerprints and the per-backend prefix index, checked by hand."""

from __future__ import annotations

import subprocess
import sys
from hashlib import blake2b
from pathlib import Path

import pytest

from policies.prefix import PrefixIndex, chat_text, fingerprint, ids_text, message_text

ROOT = Path(__file__).resolve().parents[2]


def test_chat_text_renders_each_message_in_order() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}],
        },
        {"role": "assistant", "content": None},
        "not a message",
        {"role": "user", "content": "ünïcode ✓"},
    ]
    assert chat_text(messages) == "<|system|>\nbe brief\n<|user|>\nab\n<|assistant|>\n\n<|user|>\nünïcode ✓\n"
    assert message_text("assistant", "hi") == "<|assistant|>\nhi\n"
    assert chat_text(messages[:4]) + message_text("user", "ünïcode ✓") == chat_text(messages)
    assert chat_text([{"content": "x"}]) == "<|None|>\nx\n"  # no role: rendered, not refused
    assert chat_text("not a list") == chat_text(None) == chat_text([]) == ""


def test_ids_text_is_four_big_endian_latin1_characters_per_id() -> None:
    assert ids_text([17, 2**20 + 5, 99999]) == "\x00\x00\x00\x11" + "\x00\x10\x00\x05" + "\x00\x01\x86\x9f"
    assert ids_text([1, 2, 3]) == "\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00\x00\x03"
    assert ids_text([-1, 2**32 + 7]) == "\xff\xff\xff\xff" + "\x00\x00\x00\x07"  # low 32 bits
    assert ids_text([]) == ""
    assert len(ids_text(range(512))) == 512 * 4  # a block of ids holds as many tokens as text


def test_fingerprint_is_a_chain_of_block_hashes() -> None:
    text = "abcd" * 3 + "xy"  # three whole 4-character blocks and a partial one
    h1 = blake2b(b"abcd", digest_size=8).digest()
    h2 = blake2b(h1 + b"abcd", digest_size=8).digest()
    h3 = blake2b(h2 + b"abcd", digest_size=8).digest()
    assert fingerprint(text, 4) == tuple(int.from_bytes(h, "little") for h in (h1, h2, h3))
    # equal blocks at different depths hash differently: a hash names the whole prefix
    assert len(set(fingerprint(text, 4))) == 3
    assert fingerprint("abc", 4) == ()  # no whole block, nothing to match
    with pytest.raises(ValueError):
        fingerprint(text, 0)


def test_shared_prefix_and_divergence() -> None:
    system = "You are a careful assistant. " * 10  # 290 characters
    a = fingerprint(system + "Question one?" * 20, 64)
    b = fingerprint(system + "Another thing" * 20, 64)
    shared = 290 // 64  # whole blocks inside the common text
    assert a[:shared] == b[:shared]
    assert a[shared] != b[shared]
    assert all(x != y for x, y in zip(a[shared:], b[shared:], strict=False))  # the chain stays apart


def test_non_ascii_text_is_cut_by_characters() -> None:
    text = "é" * 8
    assert fingerprint(text, 4) == fingerprint(text[:4] + "é" * 4, 4)
    assert len(fingerprint(text, 4)) == 2
    assert fingerprint("\ud800abc", 4)  # a lone surrogate (from JSON) does not raise


def test_fingerprints_agree_across_processes() -> None:
    code = "from policies.prefix import fingerprint; print(fingerprint('hello world! ' * 50, 16)[-1])"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    }
    assert runs == {str(fingerprint("hello world! " * 50, 16)[-1]) + "\n"}


def test_index_matches_leading_blocks_only() -> None:
    idx = PrefixIndex(capacity_blocks=100)
    idx.insert([1, 2, 3, 4])
    assert idx.match([1, 2, 3, 4, 5]) == 4  # a longer prompt: the first four are cached
    assert idx.match([1, 2, 9, 4]) == 2  # diverges after two
    assert idx.match([]) == 0
    assert len(idx) == 4


def test_index_evicts_least_recently_used_deepest_first() -> None:
    idx = PrefixIndex(capacity_blocks=5)
    idx.insert([1, 2, 3])  # conversation A
    idx.insert([7, 8])  # conversation B: the index is full (5 blocks)
    idx.insert([1, 2, 3, 4])  # A's next turn: one more block, so one must go: B's deepest
    assert idx.match([7, 8]) == 1 and 8 not in idx
    assert idx.match([1, 2, 3, 4]) == 4
    idx.insert([7, 9])  # B diverges: needs one block, evicts the least recent: A's deepest (4)
    assert idx.match([1, 2, 3, 4]) == 3 and idx.match([7, 9]) == 2
    assert len(idx) == 5


def test_a_match_is_a_query_and_touches_nothing() -> None:
    idx = PrefixIndex(capacity_blocks=2)
    idx.insert([1])
    idx.insert([2])
    assert idx.match([1]) == 1  # looking does not make 1 recent
    idx.insert([3])
    assert 1 not in idx and 2 in idx and 3 in idx


def test_prompt_longer_than_the_cache_keeps_its_leading_blocks() -> None:
    idx = PrefixIndex(capacity_blocks=3)
    idx.insert([1, 2, 3, 4, 5])
    assert idx.match([1, 2, 3, 4, 5]) == 3
    zero = PrefixIndex(capacity_blocks=0)
    zero.insert([1, 2])
    assert zero.match([1, 2]) == 0
