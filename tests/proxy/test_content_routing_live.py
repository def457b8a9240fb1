"""Live: the real proxy in front of emulated SGLang servers whose EAGLE acceptance follows
content rules learns the rules through the OpenAI client: after a few hundred requests each
request's predicted EAGLE speed factor is within the issue's error bound of what the backend
reports, code goes to eagle and prose where it is faster; both are logged and exported."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from pathlib import Path

from policies.features import extract_features
from policies.profile import Profile, resolve_profile
from simulator.emulator.accept_rules import parse_accept_rules

KIMI = resolve_profile("kimi-k25-int4-8gpu")
RULES = [{"match": r"\bdef \w+\(", "factor": 1.4}, {"match": "(?i)poem|story", "factor": 0.6}]
CODE = (
    "Complete the following Python function.\n\ndef {name}(values):\n    '''Return the {what} of values.'''\n"
)
PROSE = "Write a short {what} poem about {name}, with a twist at the end."
WORDS = ["rivers", "trains", "owls", "winter", "markets", "lanterns", "glaciers", "bridges", "tides", "kites"]


def fast_eagle_profile(path: Path) -> Profile:
    """The kimi profile with an EAGLE server twice as fast at every load: eagle pays for every
    request at low load, so every request's acceptance gets reported (prose included)."""
    doc = KIMI.model_dump(mode="json", exclude_none=True)
    for point in doc["modes"]["eagle"]["points"]:
        point["decode_tok_s"] *= 2
    path.write_text(json.dumps(doc))
    return Profile.model_validate(doc)


async def test_serve_learns_the_emulators_accept_rules(emulator, proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "fast-eagle.json"
    profile = fast_eagle_profile(path)
    rules = parse_accept_rules(RULES)
    base = await emulator("baseline", profile=profile, time_scale=0.01)
    eagle = await emulator("eagle", profile=profile, time_scale=0.01, accept_rules=rules)
    p = await proxy(
        baseline=[base.url],
        eagle=[eagle.url],
        policy="cost_model",
        profile=str(path),
        spec_details=True,
        decision_log=str(tmp_path / "decisions.jsonl"),
        health_check_interval_s=60,
    )
    client = p.client()
    rng = random.Random(0)

    async def one(i: int) -> None:
        kind = "code" if i % 2 else "prose"
        name, what = rng.choice(WORDS), rng.choice(("sum", "mean", "largest", "quiet", "bright"))
        text = (CODE if kind == "code" else PROSE).format(
            name=f"{name}_{i}" if kind == "code" else name, what=what
        )
        r = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": text}],
            max_tokens=200,
            extra_body={"ignore_eos": True},
        )
        assert r.usage is not None and r.usage.completion_tokens == 200

    for start in range(0, 600, 4):  # four clients at a time
        await asyncio.gather(*(one(i) for i in range(start, start + 4)))
    await client.close()

    records = p.records
    assert len(records) == 600
    late = [r for r in records[500:] if r.decision.pool == "eagle" and r.outcome.accept_length is not None]
    assert len(late) >= 50
    errors = [
        abs(r.outcome.accept_length / (2.4 * r.decision.accept_factor) - 1)  # type: ignore[operator]
        for r in late
    ]
    assert statistics.median(errors) <= 0.08
    # the two kinds are told apart: code predicted near 1.4, prose near 0.6 (every code prompt
    # starts with the same line: one family)
    code = extract_features({"messages": [{"role": "user", "content": CODE}]}, "chat").family
    by_kind: dict[bool, list[float]] = {True: [], False: []}
    for r in records[500:]:
        assert r.decision.accept_factor is not None and r.request.features is not None
        by_kind[r.request.features.family == code].append(r.decision.accept_factor)
    assert len(by_kind[True]) == len(by_kind[False]) == 50
    assert abs(statistics.median(by_kind[True]) / 1.4 - 1) < 0.08
    assert abs(statistics.median(by_kind[False]) / 0.6 - 1) < 0.08
    # what the operator sees: the decision log and the reported / predicted histogram
    await p.stop()
    lines = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert len(lines) == 600
    tail = [x for x in lines[500:] if x["accept_factor_reported"] is not None]
    assert len(tail) >= 50
    assert (
        statistics.median(abs(x["accept_factor_reported"] / x["accept_factor_predicted"] - 1) for x in tail)
        <= 0.08
    )
    count = p.sample("specroute_accept_factor_ratio_count", policy="cost_model")
    served = sum(1 for r in records if r.decision.pool == "eagle" and r.outcome.accept_length is not None)
    assert count == served >= 300
    families = p.sample("specroute_acceptance_families")
    assert families is not None and families > 0
