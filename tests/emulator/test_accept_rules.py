"""`specroute emulate --accept-rules`: the emulated EAGLE server's acceptance follows regex rules
on the canonical prompt text and the temperature; its spec_tokens_details and accept-length metric
follow; bad rules files give a clear error."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from helpers import run_specroute
from prometheus_client.parser import text_string_to_metric_families

from controller.proxy.spec_details import accept_length
from policies.profile import resolve_profile
from simulator.emulator.accept_rules import AcceptRulesError, load_accept_rules, parse_accept_rules
from simulator.emulator.app import EmulatorServer

KIMI = resolve_profile("kimi-k25-int4-8gpu")
MakeEmu = Callable[..., Awaitable[EmulatorServer]]
RULES = [
    {"match": r"def \w+\(", "factor": 1.4},
    {"match": "(?i)poem", "factor": 0.6},
    {"temperature_slope": 0.5},
]


def test_first_match_wins_and_temperature_lowers_acceptance() -> None:
    rules = parse_accept_rules(RULES)
    assert rules.factor("<|user|>\ndef add(a, b):\n", None) == 1.4
    assert rules.factor("<|user|>\nA POEM about def f(x)\n", None) == 1.4  # the first rule that matches
    assert rules.factor("write a poem", 0.0) == 0.6
    assert rules.factor("anything else", None) == 1.0
    assert rules.factor("anything else", 1.0) == pytest.approx(0.5)
    assert rules.factor("write a poem", 3.0) == pytest.approx(0.6 * 0.3)  # floored at 0.3


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"match": "x"}, "expected a JSON list"),
        ([{"match": "(", "factor": 1}], r"\[0\].match: Value error, not a regular expression"),
        ([{"match": "x", "factor": 0}], r"\[0\].factor"),
        ([{"match": "x", "factor": 1, "extra": 1}], r"\[0\].extra"),
        ([{"temperature_slope": -1}], r"\[0\]: temperature_slope must be a number >= 0"),
        (["x"], r"\[0\]"),
    ],
)
def test_bad_rules_are_named(data: Any, message: str) -> None:
    with pytest.raises(AcceptRulesError, match=message):
        parse_accept_rules(data)


def test_rules_file_errors(tmp_path: Path) -> None:
    with pytest.raises(AcceptRulesError, match="cannot read"):
        load_accept_rules(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(AcceptRulesError, match="not JSON"):
        load_accept_rules(bad)


async def _accept(server: EmulatorServer, content: str, temperature: float | None = None) -> float:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 300,
        "ignore_eos": True,
        "return_spec_tokens_details": True,
    }
    if temperature is not None:
        body["temperature"] = temperature
    async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        doc = await r.json()
    value = accept_length(doc["sglext"]["spec_tokens_details"], doc["usage"]["completion_tokens"])
    assert value is not None
    return value


async def test_the_eagle_server_follows_the_rules(emulator: MakeEmu) -> None:
    server = await emulator("eagle", accept_rules=parse_accept_rules(RULES), time_scale=0.02)
    base = KIMI.mode("eagle").accept_length or 0.0
    code = [await _accept(server, "Complete: def add(a, b):") for _ in range(4)]
    poem = [await _accept(server, "Write a poem about the sea.") for _ in range(4)]
    hot = [await _accept(server, "Tell me about rivers.", temperature=1.0) for _ in range(4)]
    assert sum(code) / 4 == pytest.approx(1.4 * base, rel=0.12)
    assert sum(poem) / 4 == pytest.approx(0.6 * base, rel=0.12)
    assert sum(hot) / 4 == pytest.approx(0.5 * base, rel=0.12)
    # the server's own accept-length gauge follows what it served last (the hot requests)
    async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
        text = await r.text()
    (family,) = (f for f in text_string_to_metric_families(text) if f.name == "sglang:spec_accept_length")
    assert family.samples[0].value == pytest.approx(0.5 * base, rel=0.15)


async def test_emulate_command_reads_the_file_or_says_why_not(tmp_path: Path) -> None:
    bad = tmp_path / "rules.json"
    bad.write_text(json.dumps([{"match": "(", "factor": 1.2}]))
    emulate = ("emulate", "--mode", "eagle", "--port", "0", "--accept-rules")
    code, _, err = await run_specroute(*emulate, str(bad))
    assert code == 2 and "rules.json[0].match" in err and "not a regular expression" in err
    code, _, err = await run_specroute(*emulate, str(tmp_path / "none"))
    assert code == 2 and "cannot read" in err
