"""Live: what `specroute serve`'s policy learned survives a SIGHUP with an unchanged config and a
restart with `state_file`, and a changed policy starts fresh and says so.

The servers are emulated SGLang servers, the EAGLE one's acceptance following content rules
(code 1.4, poems 0.6) and reported per request (`spec_details`), so `cost_model`'s content model
and calibration learn something real from the OpenAI client's requests. What the policy predicts
is read from the decision log (`accept_factor_predicted`, `predicted_e2e_s`) for *probes*: one
request per prompt family whose `max_tokens` the backend refuses (400: no outcome teaches the
policy), so the same probes sent before and after a reload or a restart must be predicted
exactly alike when, and only when, the learned state was kept."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp
import openai
from helpers import metric_samples, wait_until

from policies.profile import Profile, resolve_profile
from simulator.emulator.accept_rules import parse_accept_rules

TOKEN = "state-test-token"
RULES = [{"match": r"\bdef \w+\(", "factor": 1.4}, {"match": "(?i)poem", "factor": 0.6}]
FAMILIES = {
    "code": ("You complete Python functions.", "Complete:\n\ndef {w}(values):\n    '''Sum of values.'''\n"),
    "poems": ("You are a poet.", "Write a short poem about {w}."),
    "facts": ("You answer questions about geography.", "Where is the {w} river?"),
}
WORDS = ["rivers", "trains", "owls", "winter", "markets", "lanterns", "glaciers", "bridges", "tides", "kites"]
PROBE_TOKENS = 1_000_000
"""Over the emulator's context length: the backend answers 400, the outcome teaches nothing."""


def fast_eagle_profile() -> Profile:
    """The kimi profile with an EAGLE server twice as fast: at low load eagle serves (almost)
    every request, so acceptance gets reported for every family."""
    doc = resolve_profile("kimi-k25-int4-8gpu").model_dump(mode="json", exclude_none=True)
    for point in doc["modes"]["eagle"]["points"]:
        point["decode_tok_s"] *= 2
    return Profile.model_validate(doc)


class Serve:
    """One `specroute serve` run on a config file, its stderr read as it comes."""

    def __init__(self, sp: Any) -> None:
        self.sp = sp
        self.lines: list[str] = []
        self._pump = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while raw := await self.sp.proc.stderr.readline():
            self.lines.append(raw.decode(errors="replace"))

    def saw(self, needle: str) -> bool:
        return any(needle in line for line in self.lines)

    async def stop(self) -> None:
        self.sp.signal(signal.SIGTERM)
        assert await self.sp.wait() == 0, "".join(self.lines)
        await self._pump

    @property
    def url(self) -> str:
        return str(self.sp.url)


async def _teach(url: str, requests: int = 150) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kinds = list(FAMILIES.values())

    async def one(i: int) -> None:
        system, user = kinds[i % len(kinds)]
        text = user.format(w=f"{WORDS[i % len(WORDS)]}_{i}")
        # streamed: the calibration learns from each answer's decode rate as well
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "system", "content": system}, {"role": "user", "content": text}],
            max_tokens=24, extra_body={"ignore_eos": True}, stream=True,
        )  # fmt: skip
        async for _ in stream:
            pass

    for start in range(0, requests, 3):
        await asyncio.gather(*(one(i) for i in range(start, min(start + 3, requests))))
    await client.close()


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


async def _probe(url: str, log: Path) -> list[dict[str, Any]]:
    """One refused request per family, one at a time (a probe's booked prefill has drained before
    the next); returns their decision-log records: what the policy predicted for each."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = len(_lines(log))
    for system, user in FAMILIES.values():
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": user.format(w="probe")},
        ]
        try:
            await client.chat.completions.create(model="m", max_tokens=PROBE_TOKENS, messages=messages)  # type: ignore[arg-type]
            raise AssertionError("the probe was answered; it should have been refused")
        except openai.BadRequestError:
            pass
        await asyncio.sleep(0.2)
    await client.close()

    # the log is written behind the requests: a training request's line may come after `before`
    def probes() -> list[dict[str, Any]]:
        return [r for r in map(json.loads, _lines(log)[before:]) if r["max_tokens"] == PROBE_TOKENS]

    assert await wait_until(lambda: len(probes()) >= len(FAMILIES), 10.0)
    records = probes()
    assert len(records) == len(FAMILIES) and all(r["status"] == "client_error" for r in records), records
    keys = ("pool", "accept_factor_predicted", "predicted_e2e_s", "predicted_ttft_s")
    return [{k: r[k] for k in keys} for r in records]


async def _learned(url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as s, s.get(url + "/admin/policy", headers=headers) as r:
        assert r.status == 200
        body: dict[str, Any] = await r.json()
    return body


async def _one(url: str, name: str, **labels: str) -> float:
    samples = await metric_samples(url, name)
    return samples.get(tuple(sorted(labels.items())), -1.0)


async def _idle(url: str) -> bool:
    """serve's latest load samples show both backends idle (the probes then see the same load
    before and after: the samples taken while it was taught showed requests running)."""
    running = await metric_samples(url, "specroute_backend_running_requests")
    return len(running) == 2 and set(running.values()) == {0.0}


async def test_sighup_with_an_unchanged_config_and_a_restart_keep_what_the_policy_learned(
    emulator: Any, spawn_serve: Any, tmp_path: Path
) -> None:
    profile = fast_eagle_profile()
    profile_path = tmp_path / "fast-eagle.json"
    profile_path.write_text(profile.model_dump_json(exclude_none=True))
    base = await emulator("baseline", profile=profile, time_scale=0.01)
    eagle = await emulator("eagle", profile=profile, time_scale=0.01, accept_rules=parse_accept_rules(RULES))
    log, state = tmp_path / "decisions.jsonl", tmp_path / "state.json"
    config = tmp_path / "specroute.yaml"
    head = (
        f"baseline: [{base.url}]\neagle: [{eagle.url}]\nprofile: {profile_path}\npolicy: cost_model\n"
        f"spec_details: true\ndecision_log: {log}\nstate_file: {state}\nstate_save_interval_s: 3600\n"
    )
    config.write_text(head + "policy_params: {objective: e2e, count_arrivals: false}\n")
    env = {"SPECROUTE_ADMIN_TOKEN": TOKEN}
    # (the probes compare decisions, which with the arrival count also follow the clock and the
    # decisions just made -- not learned, never saved: it is off)

    first = Serve(await spawn_serve("--config", str(config), env=env))
    assert await wait_until(lambda: first.saw("does not exist yet"), 10.0)
    assert await _one(first.url, "specroute_state_loads_total", result="absent") == 1
    await _teach(first.url)
    assert await wait_until(lambda: _idle(first.url), 10.0)
    families = await _one(first.url, "specroute_acceptance_families")
    learned = await _learned(first.url)
    assert families == 3, families
    assert learned["learned"]["content"]["families"] == 3 and learned["learned"]["content"]["outcomes"] >= 50
    assert learned["learned"]["calibration"]["eagle"]["outcomes"] > 0
    probes = await _probe(first.url, log)
    assert len({p["accept_factor_predicted"] for p in probes}) == 3  # the families are told apart
    code, poems, _ = (p["accept_factor_predicted"] for p in probes)
    assert code > 1.15 and poems < 0.8, probes

    # 1. SIGHUP, the file unchanged: the same policy object goes on, with what it learned
    first.sp.signal(signal.SIGHUP)

    async def reloaded() -> bool:
        return await _one(first.url, "specroute_config_reloads_total", result="ok") == 1

    assert await wait_until(reloaded, 10.0)
    assert await _one(first.url, "specroute_policy_reloads_total", source="sighup", learned="kept") == 1
    assert await _one(first.url, "specroute_policy_reloads_total", source="sighup", learned="reset") == 0
    assert await _one(first.url, "specroute_acceptance_families") == families
    assert await _learned(first.url) == learned
    assert await _probe(first.url, log) == probes
    assert first.saw("unchanged: it keeps what it has learned")

    # 2. a restart with state_file: saved at shutdown, loaded at start, predicted alike
    await first.stop()
    saved = json.loads(state.read_text())
    assert saved["format"] == "specroute.state" and saved["policy"]["name"] == "cost_model"
    second = Serve(await spawn_serve("--config", str(config), env=env))
    assert await _one(second.url, "specroute_state_loads_total", result="loaded") == 1
    assert second.saw("goes on from what it had learned")
    assert await _one(second.url, "specroute_acceptance_families") == families
    assert await _learned(second.url) == learned
    assert await wait_until(lambda: _idle(second.url), 10.0)
    assert await _probe(second.url, log) == probes

    # 3. SIGHUP with other parameters: a fresh policy, said in the log and the metric
    config.write_text(head + "policy_params: {objective: ttft, count_arrivals: false}\n")
    second.sp.signal(signal.SIGHUP)

    async def reset() -> bool:
        return await _one(second.url, "specroute_policy_reloads_total", source="sighup", learned="reset") == 1

    assert await wait_until(reset, 10.0)
    assert await _one(second.url, "specroute_acceptance_families") == 0
    fresh = await _learned(second.url)
    assert fresh["params"] == {"objective": "ttft", "count_arrivals": False}
    assert fresh["learned"]["content"]["outcomes"] == 0
    assert second.saw("starts with nothing learned; what cost_model had learned is dropped")
    await second.stop()

    # 4. the state file now belongs to the new parameters: the old ones start fresh, and say why
    config.write_text(head + "policy_params: {objective: e2e, count_arrivals: false}\n")
    third = Serve(await spawn_serve("--config", str(config), env=env))
    assert await _one(third.url, "specroute_state_loads_total", result="other_policy") == 1
    assert third.saw("saved for another policy (params objective differ)")
    assert await _one(third.url, "specroute_acceptance_families") == 0
    await third.stop()
