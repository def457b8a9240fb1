"""Two domains of seeded, generated prompts, code and prose: what `specroute demo`'s content act
sends, and the text the real-engine benchmark's tiny model is trained on and asked
(benchmarks/vllm/domains.py).

Each document is one chat turn: a user prompt and an assistant answer. Code: a Python function's
signature and docstring, answered with its body, a test and a helper; the body follows from the
verb in the function's name. Prose: a request for a story or a description, answered along a
fixed outline whose slots the prompt fills (a name, a trade, a place) or the seed does (the
rest). Both answers run well past 64 tokens.

Prompts are drawn by index from a named stream (`prompts(domain, stream, n)`): a document's text
depends on its domain, stream, index and seed only, so different streams give prompts a server
has not seen, and the same stream gives the same prompts on every machine. Pure Python, no
imports beyond the standard library (the benchmark's model build imports it from a virtual
environment where specroute is not installed).
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from typing import Literal

Domain = Literal["code", "prose"]
DOMAINS: tuple[Domain, ...] = ("code", "prose")

VERBS = ("count", "total", "find", "filter", "scale", "clean", "group", "merge")
NOUNS = (
    "items", "values", "rows", "users", "names", "words", "files", "orders", "scores", "prices",
    "lines", "keys", "nodes", "tasks", "events", "records", "points", "tokens", "pages", "cards",
)  # fmt: skip
ADJECTIVES = ("valid", "active", "large", "empty", "recent", "unique", "sorted", "missing", "open", "hidden")
SECOND = ("limit", "key", "threshold", "factor", "label", "default", "size", "start")
FIELDS = ("score", "size", "count", "weight", "level", "price", "age", "rank")

NAMES = (
    "Mara", "Tobin", "Elsa", "Ravi", "Nora", "Felix", "Ines", "Omar", "Lena", "Hugo", "Ada", "Milo",
    "Petra", "Jonas", "Wren", "Selim", "Clara", "Bruno", "Yara", "Ivo",
)  # fmt: skip
TRADES = ("baker", "sailor", "farmer", "teacher", "painter", "doctor", "miner", "weaver", "fisher", "singer")
PLACES = ("river", "harbor", "forest", "market", "valley", "village", "lake", "bridge", "garden", "mountain")
TIMES = ("morning", "evening", "spring", "winter", "Sunday", "night", "autumn", "dawn")
THINGS = (
    "old boat", "red lantern", "stone wall", "tall tree", "little bell", "blue door", "iron gate",
    "wooden cart",
)  # fmt: skip
MOODS = ("quiet", "bright", "ancient", "gentle", "broken", "golden", "cold", "warm", "narrow", "wild")
VISITORS = ("stranger", "child", "merchant", "traveler", "soldier", "poet", "shepherd", "widow")
WEATHER = ("rain", "storm", "snow", "dark", "fog", "wind")
SEASONS = ("spring", "summer", "autumn", "winter")
SOUNDS = ("bells", "birds", "wheels", "voices", "waves", "hammers")


@dataclass(frozen=True)
class Document:
    domain: Domain
    prompt: str
    answer: str


def _singular(noun: str) -> str:
    return noun[:-1]


def _code(rng: random.Random) -> Document:
    verb, noun, adj = rng.choice(VERBS), rng.choice(NOUNS), rng.choice(ADJECTIVES)
    second, field = rng.choice(SECOND), rng.choice(FIELDS)
    one = _singular(noun)
    name = f"{verb}_{adj}_{noun}"
    prompt = (
        "Complete the following Python function.\n\n"
        f"def {name}({noun}, {second}):\n"
        f'    """{verb.capitalize()} the {adj} {noun} by {field}, using {second}."""\n'
    )
    loop = f"    for {one} in {noun}:\n"
    bodies = {
        "count": f"    count = 0\n{loop}        if {one}.{adj} and {one}.{field} > {second}:\n"
        f"            count += 1\n    return count\n",
        "total": f"    total = 0\n{loop}        if {one}.{adj}:\n"
        f"            total += {one}.{field} * {second}\n    return total\n",
        "find": f"{loop}        if {one}.{adj} and {one}.{field} == {second}:\n"
        f"            return {one}\n    return None\n",
        "filter": f"    result = []\n{loop}        if {one}.{adj} and {one}.{field} >= {second}:\n"
        f"            result.append({one})\n    return result\n",
        "scale": f"    scaled = []\n{loop}        {one}.{field} = {one}.{field} * {second}\n"
        f"        scaled.append({one})\n    return scaled\n",
        "clean": f"    cleaned = []\n{loop}        if {one} is None or not {one}.{adj}:\n"
        f"            continue\n        cleaned.append({one})\n    return cleaned[:{second}]\n",
        "group": f"    groups = {{}}\n{loop}        key = {one}.{field} // {second}\n"
        f"        groups.setdefault(key, []).append({one})\n    return groups\n",
        "merge": f"    merged = {{}}\n{loop}        if {one}.{adj}:\n"
        f"            merged[{one}.{field}] = {one}\n    return list(merged.values())[:{second}]\n",
    }
    size, other = rng.randint(2, 9), rng.choice(VERBS)
    answer = (
        bodies[verb]
        + f"\n\ndef test_{name}():\n    {noun} = make_{noun}({size})\n"
        + f"    result = {name}({noun}, {rng.randint(1, 5)})\n    assert result is not None\n"
        + f"\n\ndef {other}_{noun}({noun}):\n    return {name}({noun}, {second}={size})\n"
    )
    return Document("code", prompt, answer)


def _prose(rng: random.Random) -> Document:
    name, trade, place = rng.choice(NAMES), rng.choice(TRADES), rng.choice(PLACES)
    time, thing, visitor = rng.choice(TIMES), rng.choice(THINGS), rng.choice(VISITORS)
    mood, mood2, weather = rng.choice(MOODS), rng.choice(MOODS), rng.choice(WEATHER)
    if rng.random() < 0.5:
        prompt = f"Write a short story about {name}, a {trade} who lives near the {place}."
        answer = (
            f"{name} was a {trade} who lived near the {place}. Every {time}, {name} walked to the {place} "
            f"to look at the {thing}. The {thing} was {mood} and {mood2}, and {name} loved it. One {time}, "
            f"a {visitor} came to the {place} and asked about the {thing}. {name} smiled and told the "
            f"{visitor} that the {thing} had stood there for {rng.randint(3, 90)} years. The {visitor} "
            f"thanked {name} and went home before the {weather}. After that day, {name} was never lonely "
            f"again, and the {trade} kept the {thing} {mood} for the next {visitor}."
        )
    else:
        season, sound = rng.choice(SEASONS), rng.choice(SOUNDS)
        prompt = f"Describe the {place} where {name} the {trade} works in {season}."
        answer = (
            f"In {season} the {place} is {mood} and full of {sound}. {name} the {trade} arrives at {time} "
            f"and opens the {thing}. The air smells of {weather} and bread, and the {sound} grow louder as "
            f"the day goes on. A {visitor} stops to talk with {name} about the {place}, and they agree that "
            f"nothing is as {mood2} as the {place} in {season}. When the light fades, {name} closes the "
            f"{thing} and walks home along the {place}, listening to the last {sound}."
        )
    return Document("prose", prompt, answer)


def _rng(domain: Domain, stream: str, index: int, seed: int) -> random.Random:
    # one generator per document: a prompt's text depends on its stream and index only
    return random.Random(zlib.crc32(f"{seed}/{domain}/{stream}/{index}".encode()))


def document(domain: Domain, stream: str, index: int, seed: int = 0) -> Document:
    """The `index`-th document of `domain` in `stream`."""
    rng = _rng(domain, stream, index, seed)
    return _code(rng) if domain == "code" else _prose(rng)


def documents(domain: Domain, stream: str, n: int, seed: int = 0) -> list[Document]:
    return [document(domain, stream, i, seed) for i in range(n)]


def prompts(domain: Domain, stream: str, n: int, seed: int = 0) -> list[str]:
    """`n` distinct prompts of `domain` from `stream` (documents whose prompt repeats one already
    drawn are skipped)."""
    out: list[str] = []
    seen: set[str] = set()
    i = 0
    while len(out) < n:
        text = document(domain, stream, i, seed).prompt
        i += 1
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def mixed(stream: str, n: int, seed: int = 0) -> list[tuple[Domain, str]]:
    """`n` prompts alternating code and prose (code first): the 50/50 traffic."""
    code, prose = prompts("code", stream, (n + 1) // 2, seed), prompts("prose", stream, n // 2, seed)
    out: list[tuple[Domain, str]] = []
    for i in range(n):
        out.append(("code", code[i // 2]) if i % 2 == 0 else ("prose", prose[i // 2]))
    return out


def prompt_lines(items: list[tuple[Domain, str]]) -> str:
    """`items` as a prompts file (`specroute bench --prompts`): one chat turn a line, with its
    domain as the `category`."""
    return "".join(
        json.dumps({"category": domain, "messages": [{"role": "user", "content": text}]}) + "\n"
        for domain, text in items
    )
