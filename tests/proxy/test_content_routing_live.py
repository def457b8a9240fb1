"""Live: `specroute serve` in front of emulated SGLang servers -- the EAGLE one started as
`specroute emulate --accept-rules FILE`, its acceptance following content rules -- learns the
rules through the OpenAI client: after 500 requests each request's predicted EAGLE speed factor
is within the issue's error bound of what the backend reports (decision log), code and poems are
told apart, and the reported / predicted histogram and the families gauge are exported."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import statistics
from pathlib import Path
from typing import Any

import aiohttp
import openai
from helpers import start_module
from prometheus_client.parser import text_string_to_metric_families

from controller.cli import spawn
from policies.profile import Profile, resolve_profile

KIMI = resolve_profile("kimi-k25-int4-8gpu")
RULES = [{"match": r"\bdef \w+\(", "factor": 1.4}, {"match": "(?i)poem|story", "factor": 0.6}]
CODE = (
    "Complete the following Python function.\n\ndef {name}(values):\n    '''Return the {what} of values.'''\n"
)
PROSE = "Write a short {what} poem about {name}, with a twist at the end."
WORDS = ["rivers", "trains", "owls", "winter", "markets", "lanterns", "glaciers", "bridges", "tides", "kites"]
CODE_TOKENS, PROSE_TOKENS = 200, 199
"""Answer lengths, one per kind: the decision log tells the kinds apart by max_tokens."""


def fast_eagle_profile(path: Path) -> Profile:
    """The kimi profile with an EAGLE server twice as fast at every load: eagle pays for every
    request at low load, so every request's acceptance gets reported (poems included)."""
    doc = KIMI.model_dump(mode="json", exclude_none=True)
    for point in doc["modes"]["eagle"]["points"]:
        point["decode_tok_s"] *= 2
    path.write_text(json.dumps(doc))
    return Profile.model_validate(doc)


async def test_serve_learns_the_emulators_accept_rules(
    emulator: Any, spawn_serve: Any, tmp_path: Path
) -> None:
    profile_path = tmp_path / "fast-eagle.json"
    profile = fast_eagle_profile(profile_path)
    rules_path = tmp_path / "rules.json"
    rules_path.write_text(json.dumps(RULES))
    base = await emulator("baseline", profile=profile, time_scale=0.01)
    proc, line = await start_module(
        "controller.cli", "emulate", "--mode", "eagle", "--port", "0", "--profile", str(profile_path),
        "--time-scale", "0.01", "--accept-rules", str(rules_path),
    )  # fmt: skip
    log = tmp_path / "decisions.jsonl"
    try:
        sp = await spawn_serve(
            "--baseline", base.url, "--eagle", spawn.url_of(line), "--profile", str(profile_path),
            "--policy", "cost_model", "--spec-details", "true", "--decision-log", str(log),
        )  # fmt: skip
        client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        rng = random.Random(0)

        async def one(i: int) -> None:
            name, what = rng.choice(WORDS), rng.choice(("sum", "mean", "largest", "quiet", "bright"))
            code = i % 2 == 1
            text = CODE.format(name=f"{name}_{i}", what=what) if code else PROSE.format(name=name, what=what)
            n = CODE_TOKENS if code else PROSE_TOKENS
            r = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": text}], max_tokens=n,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.usage is not None and r.usage.completion_tokens == n

        for start in range(0, 600, 4):  # four clients at a time
            await asyncio.gather(*(one(i) for i in range(start, start + 4)))
        await client.close()
        async with aiohttp.ClientSession() as s, s.get(sp.url + "/metrics") as resp:
            families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        sp.signal(signal.SIGTERM)
        assert await sp.wait() == 0  # the decision log is flushed on exit
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()

    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 600
    late = [x for x in lines[500:] if x["accept_factor_reported"] is not None]
    assert len(late) >= 50
    errors = [abs(x["accept_factor_reported"] / x["accept_factor_predicted"] - 1) for x in late]
    assert statistics.median(errors) <= 0.08
    # the two kinds are told apart: code predicted near 1.4, poems near 0.6
    code = [x["accept_factor_predicted"] for x in lines[500:] if x["max_tokens"] == CODE_TOKENS]
    poem = [x["accept_factor_predicted"] for x in lines[500:] if x["max_tokens"] == PROSE_TOKENS]
    assert len(code) == len(poem) == 50
    assert abs(statistics.median(code) / 1.4 - 1) < 0.08
    assert abs(statistics.median(poem) / 0.6 - 1) < 0.08
    # what the operator sees: reported / predicted per request served by eagle, and the families
    ratio = families["specroute_accept_factor_ratio"]
    (count,) = (s.value for s in ratio.samples if s.name.endswith("_count"))
    assert count == sum(1 for x in lines if x["accept_factor_reported"] is not None) >= 300
    (tracked,) = (s.value for s in families["specroute_acceptance_families"].samples)
    assert tracked > 0
