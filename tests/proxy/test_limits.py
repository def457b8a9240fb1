"""The JSON budget counts a body's structure exactly, however it is cut into slices, and refuses
what is over it; bounded backend reads stop at their bound."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from controller.proxy.errors import PayloadTooLarge
from controller.proxy.limits import JsonBudget

TRICKY_STRINGS = ['"', "\\", '\\"', '"\\', "\\\\", '\\\\"', "[{,:}]", "é\u2028", "a\\nb", '", "x": [', ""]


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.random()
    if depth > 4 or kind < 0.3:
        return rng.choice(
            [rng.choice(TRICKY_STRINGS) * rng.randint(0, 3), rng.randint(-9, 99), 1.5, True, None]
        )
    if kind < 0.65:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {
        rng.choice(TRICKY_STRINGS) + str(i): _random_json(rng, depth + 1) for i in range(rng.randint(0, 5))
    }


def _truth(value: Any) -> tuple[int, int]:
    """(items, containers) as the budget defines them: commas, colons and brackets outside strings."""
    if isinstance(value, list):
        items, containers = 1 + max(0, len(value) - 1), 1
        for v in value:
            i, c = _truth(v)
            items, containers = items + i, containers + c
        return items, containers
    if isinstance(value, dict):
        items, containers = 1 + max(0, len(value) - 1) + len(value), 1
        for v in value.values():
            i, c = _truth(v)
            items, containers = items + i, containers + c
        return items, containers
    return 0, 0


def _scanning_budget(raw: bytes, slice_bytes: int) -> JsonBudget:
    """A budget that `raw` cannot exceed (each counted item is a byte of it) but that is too
    small to skip the scan of `raw`."""
    return JsonBudget(len(raw) - 1, len(raw) - 1, slice_bytes=slice_bytes)


def _feed_in_pieces(budget: JsonBudget, text: bytes, rng: random.Random) -> None:
    """Feed `text` as a network would: growing by random amounts, then the end."""
    end = 0
    while end < len(text):
        end = min(len(text), end + rng.randint(1, 40))
        budget.feed(text[:end], final=False)
    budget.feed(text, final=True)


@pytest.mark.parametrize("seed", range(40))
def test_budget_counts_exactly_whatever_the_slicing(seed):
    rng = random.Random(seed)
    doc = {"messages": [_random_json(rng) for _ in range(rng.randint(1, 6))], "stream": True}
    text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, separators=rng.choice([(",", ":"), (", ", ": ")]))
    raw = text.encode()
    items, containers = _truth(doc)
    for slice_bytes in (1, 2, 3, 7, 64, 1 << 20):
        budget = _scanning_budget(raw, slice_bytes)
        _feed_in_pieces(budget, raw, rng)
        assert (budget.values, budget.containers) == (items, containers), (slice_bytes, text)
        assert budget.scanned == len(raw)


def test_backslash_runs_across_slices_keep_their_pairing():
    # 1..6 backslashes before a quote, cut at every position: odd runs escape the quote
    for run in range(1, 7):
        value = "x" + "\\" * (run // 2) + ('"' if run % 2 else "") + "y"
        raw = json.dumps([value, [1, 2]]).encode()
        for slice_bytes in range(1, len(raw) + 1):
            budget = _scanning_budget(raw, slice_bytes)
            budget.feed(raw, final=True)
            assert (budget.values, budget.containers) == (4, 2), (run, slice_bytes, raw)


def test_over_budget_is_refused_as_soon_as_it_is_seen():
    hostile = b'{"messages": [], "x": [' + b"[]," * 1_000_000 + b"[]]}"
    budget = JsonBudget(500_000, 100_000)
    with pytest.raises(PayloadTooLarge, match="more than 100000 JSON objects and arrays"):
        _feed_in_pieces_large(budget, hostile)
    assert budget.scanned < len(hostile) // 4  # it stopped early, not after the last byte
    values = b'{"prompt": [' + b"1," * 600_000 + b"1]}"
    with pytest.raises(PayloadTooLarge, match="more than 500000 JSON values"):
        JsonBudget(500_000, 100_000).feed(values, final=True)


def _feed_in_pieces_large(budget: JsonBudget, text: bytes) -> None:
    for end in range(65536, len(text), 65536):
        budget.feed(text[:end], final=False)
    budget.feed(text, final=True)


def test_a_large_prompt_with_much_punctuation_in_its_strings_is_within_budget():
    code = "def f(a, b):\n    return {'x': [a, b], \"y\": (a, b)}\n" * 40_000  # ~2 MB, 400k commas
    raw = json.dumps({"messages": [{"role": "user", "content": code}], "stream": True}).encode()
    budget = JsonBudget(500_000, 100_000)
    budget.feed(raw, final=True)
    assert (budget.values, budget.containers) == _truth(json.loads(raw))


def test_a_small_body_is_not_scanned():
    budget = JsonBudget(500_000, 100_000)
    budget.feed(b'{"messages": [[], [], []]}', final=True)
    assert budget.scanned == 26 and budget.values == 0  # too short to be over budget: skipped
