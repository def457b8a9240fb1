"""The state file (`controller.proxy.learned_state`): written whole or not at all, bounded, and
at start a corrupt, foreign, other-version, oversized or other-policy file is ignored with a
warning (serve starts, the policy fresh); the prefix beliefs come back for the same backends;
serve refuses a state file it could never write; SIGUSR1 reopens the decision log and reloads
nothing."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from helpers import BODY, fill_file_system, metric_samples, run_specroute, wait_until
from pydantic import BaseModel, ConfigDict

from controller.proxy import learned_state
from controller.proxy.app import ADMIN, FORWARDER, METRICS, SETTINGS, TRACKER
from controller.proxy.learned_state import StateKeeper, keeper_for
from policies.base import Decision, LoadView, Outcome, RequestInfo
from policies.routing import route
from policies.spec import PolicyContext

BLOCKS = list(range(1000, 1040))


def _teach(policy: Any, n: int = 80) -> None:
    """Teach a cost_model directly (its calibration), as outcomes would."""
    rng = random.Random(0)
    for _ in range(n):
        policy.calibration.observe("eagle", rng.randrange(1, 20), None, rng.uniform(1.2, 1.4), None)


def _keeper_of(app: Any) -> StateKeeper:
    return keeper_for(app[SETTINGS], app[ADMIN], app[TRACKER], app[METRICS].registry)


async def _keeper(proxy: Any, fake_backend: Any, path: Path, **settings: Any) -> tuple[Any, StateKeeper]:
    base, eagle = await fake_backend(), await fake_backend()
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="cost_model", profile="kimi-k25-int4-8gpu",
        state_file=str(path), **settings,
    )  # fmt: skip
    return p, _keeper_of(p.app)


async def _loads(p: Any) -> dict[str, float]:
    samples = await metric_samples(p.url, "specroute_state_loads_total")
    return {dict(k)["result"]: v for k, v in samples.items()}


async def test_saved_state_loads_into_a_new_proxy_with_the_prefix_beliefs(proxy, fake_backend, tmp_path):
    path = tmp_path / "state.json"
    p, keeper = await _keeper(proxy, fake_backend, path)
    _teach(p.app[FORWARDER].policy)
    for b in p.app[TRACKER]:
        b.prefixes.insert(BLOCKS)
    assert await keeper.save() == "ok"
    assert [f.name for f in tmp_path.iterdir()] == ["state.json"]  # no temporary file left behind
    saved = json.loads(path.read_text())
    assert saved["format"] == "specroute.state" and saved["version"] == 1
    # a second proxy on the same backends (same names and URLs): everything comes back
    q = await proxy(
        baseline=[b.url for b in p.app[TRACKER] if b.pool == "baseline"],
        eagle=[b.url for b in p.app[TRACKER] if b.pool == "eagle"],
        policy="cost_model", profile="kimi-k25-int4-8gpu", state_file=str(path),
    )  # fmt: skip
    assert _keeper_of(q.app).load() == "loaded"
    assert q.app[FORWARDER].policy.state() == p.app[FORWARDER].policy.state()
    assert all(b.prefixes.match(BLOCKS) == len(BLOCKS) for b in q.app[TRACKER])
    assert (await _loads(q))["loaded"] == 1


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"\x00\xff not json", "not JSON"),
        (b'{"format": "specroute.state", "version": 1', "not JSON"),
        (b"[1, 2, 3]", "not a specroute state file"),
        (b'{"format": "someone.else", "version": 1}', "not a specroute state file"),
        (b'{"format": "specroute.state", "version": 2}', "state file version 2"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
    ],
)
async def test_a_corrupt_or_foreign_file_is_ignored_with_a_warning(
    proxy, fake_backend, tmp_path, caplog, content: bytes, why: str
):
    path = tmp_path / "state.json"
    path.write_bytes(content)
    p, keeper = await _keeper(proxy, fake_backend, path)
    before = p.app[FORWARDER].policy.state()
    with caplog.at_level(logging.WARNING, "specroute.state"):
        assert keeper.load() == "invalid"
    assert why in caplog.text and "the policy starts fresh" in caplog.text
    assert p.app[FORWARDER].policy.state() == before
    assert (await _loads(p))["invalid"] == 1
    assert path.read_bytes() == content  # left for the operator to look at, until the next save


async def test_learned_state_the_policy_refuses_leaves_it_fresh(proxy, fake_backend, tmp_path, caplog):
    path = tmp_path / "state.json"
    p, keeper = await _keeper(proxy, fake_backend, path)
    _teach(p.app[FORWARDER].policy)
    assert await keeper.save() == "ok"
    doc = json.loads(path.read_text())
    doc["learned"]["content"]["token_weights"] = "not base64!"
    path.write_text(json.dumps(doc))
    q, other = await _keeper(proxy, fake_backend, path)
    fresh = q.app[FORWARDER].policy.state()
    with caplog.at_level(logging.WARNING, "specroute.state"):
        assert other.load() == "invalid"
    assert "the learned state is ignored" in caplog.text and "content model: not base64" in caplog.text
    assert q.app[FORWARDER].policy.state() == fresh


async def test_state_saved_for_other_parameters_is_not_loaded(proxy, fake_backend, tmp_path, caplog):
    path = tmp_path / "state.json"
    p, keeper = await _keeper(proxy, fake_backend, path)
    _teach(p.app[FORWARDER].policy)
    assert await keeper.save() == "ok"
    base, eagle = await fake_backend(), await fake_backend()
    q = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="cost_model", profile="llama31-8b-h100-eagle3",
        policy_params={"calibration_window": 100}, state_file=str(path), seed=3,
    )  # fmt: skip
    fresh = q.app[FORWARDER].policy.state()
    with caplog.at_level(logging.WARNING, "specroute.state"):
        assert _keeper_of(q.app).load() == "other_policy"
    assert "(params calibration_window; profile; seed differ)" in caplog.text
    assert q.app[FORWARDER].policy.state() == fresh
    # the defaults written out are the same policy: {} and {"calibrate": true} alike
    r = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="cost_model", profile="kimi-k25-int4-8gpu",
        policy_params={"calibrate": True, "objective": "e2e"}, state_file=str(path),
    )  # fmt: skip
    assert _keeper_of(r.app).load() == "loaded"


async def test_an_oversized_file_is_neither_read_nor_written(
    proxy, fake_backend, tmp_path, monkeypatch, caplog
):
    path = tmp_path / "state.json"
    p, keeper = await _keeper(proxy, fake_backend, path, prefix_cache_tokens=10_000_000)
    rng = random.Random(1)
    for b in p.app[TRACKER]:
        b.prefixes.insert([rng.getrandbits(64) for _ in range(5000)])
    assert await keeper.save() == "ok"
    whole = path.stat().st_size
    without_prefixes = len(learned_state._encode(keeper.snapshot(prefixes=False)))
    assert whole > without_prefixes + 50_000
    # over the bound with the prefix beliefs, under it without: saved without them
    monkeypatch.setattr(learned_state, "MAX_BYTES", without_prefixes + 1000)
    with caplog.at_level(logging.WARNING, "specroute.state"):
        assert await keeper.save() == "ok"
    assert "saved without them" in caplog.text
    assert json.loads(path.read_text())["prefixes"] == []
    # under neither: not written, the last good file stays
    kept = path.read_bytes()
    monkeypatch.setattr(learned_state, "MAX_BYTES", 100)
    assert await keeper.save() == "too_large"
    assert path.read_bytes() == kept
    # and not read either
    caplog.clear()
    with caplog.at_level(logging.WARNING, "specroute.state"):
        assert keeper.load() == "invalid"
    assert "over the 100 a state file may hold" in caplog.text
    saves = await metric_samples(p.url, "specroute_state_saves_total")
    assert {dict(k)["result"]: v for k, v in saves.items()} == {
        "ok": 2, "error": 0, "too_large": 1, "unencodable": 0,
    }  # fmt: skip


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
async def test_a_save_the_disk_refuses_keeps_the_old_file_and_serving(proxy, fake_backend, tmp_path, caplog):
    directory = tmp_path / "state"
    directory.mkdir()
    path = directory / "state.json"
    p, keeper = await _keeper(proxy, fake_backend, path)
    assert await keeper.save() == "ok"
    kept = path.read_bytes()
    _teach(p.app[FORWARDER].policy)
    directory.chmod(0o500)
    try:
        with caplog.at_level(logging.ERROR, "specroute.state"):
            assert await keeper.save() == "error"
            assert await keeper.save() == "error"
        assert caplog.text.count("not saved (the old file stays)") == 1  # once per streak
    finally:
        directory.chmod(0o700)
    assert path.read_bytes() == kept
    assert await keeper.save() == "ok" and path.read_bytes() != kept


async def test_a_save_on_a_full_disk_keeps_the_old_file(proxy, fake_backend, tiny_tmpfs):
    path = tiny_tmpfs / "state.json"
    p, keeper = await _keeper(proxy, fake_backend, path)
    assert await keeper.save() == "ok"
    kept = path.read_bytes()
    _teach(p.app[FORWARDER].policy)
    filler = tiny_tmpfs / "filler"
    await asyncio.to_thread(fill_file_system, filler, 0)
    assert await keeper.save() == "error"
    assert path.read_bytes() == kept
    assert sorted(f.name for f in tiny_tmpfs.iterdir()) == ["filler", "state.json"]  # no torn temporary
    filler.unlink()
    assert await keeper.save() == "ok" and path.read_bytes() != kept


async def test_the_state_is_saved_periodically_while_serving(proxy, fake_backend, tmp_path):
    path = tmp_path / "state.json"
    p, keeper = await _keeper(proxy, fake_backend, path, state_save_interval_s=0.05)
    keeper.start()
    assert await wait_until(path.exists, 5.0)
    _teach(p.app[FORWARDER].policy)
    taught = p.app[FORWARDER].policy.calibration.state()

    def caught_up() -> bool:
        return json.loads(path.read_text())["learned"]["calibration"] == taught

    assert await wait_until(caught_up, 5.0)
    assert await keeper.stop() == "ok"


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: d / "a-file" / "state.json", "a-file is not a directory"),
        (lambda d: d, "is a directory"),
    ],
)
async def test_serve_refuses_a_state_file_it_could_never_write(tmp_path, setup: Any, message: str):
    (tmp_path / "a-file").write_text("")
    path = setup(tmp_path)
    code, _, err = await run_specroute(
        "serve", "--baseline", "http://127.0.0.1:9", "--state-file", str(path), "--port", "0"
    )
    assert code != 0 and f"state_file {path}" in err and message in err, err


async def test_the_state_directory_is_made_at_the_first_save_not_before(proxy, fake_backend, tmp_path):
    path = tmp_path / "state" / "deeper" / "state.json"
    code, _, err = await run_specroute(
        "serve",
        "--baseline",
        "http://127.0.0.1:9",
        "--state-file",
        str(path),
        "--port",
        "1",
        "--host",
        "256.0.0.1",
    )
    assert code != 0 and "cannot listen" in err, err
    assert not (tmp_path / "state").exists()  # the bind failed: nothing was created
    _, keeper = await _keeper(proxy, fake_backend, path)
    assert keeper.load() == "absent"
    assert await keeper.save() == "ok" and path.exists()


async def test_sigusr1_reopens_the_decision_log_and_reloads_nothing(fake_backend, spawn_serve, tmp_path):
    base, eagle = await fake_backend(), await fake_backend()
    log, config = tmp_path / "decisions.jsonl", tmp_path / "specroute.yaml"
    config.write_text(
        f"baseline: [{base.url}]\neagle: [{eagle.url}]\npolicy: fixed\npolicy_params: {{pool: baseline}}\n"
        f"decision_log: {log}\n"
    )
    sp = await spawn_serve("--config", str(config), stderr=asyncio.subprocess.DEVNULL)

    async def post() -> None:
        async with aiohttp.ClientSession() as s, s.post(sp.url + "/v1/chat/completions", json=BODY) as r:
            assert r.status == 200 and r.headers["x-specroute-pool"] == "baseline"
            await r.read()

    await post()
    assert await wait_until(lambda: log.exists() and log.read_text().count("\n") == 1)
    log.rename(tmp_path / "decisions.jsonl.1")
    # the file now names another pool: a reload would apply it, a reopen must not
    config.write_text(config.read_text().replace("{pool: baseline}", "{pool: eagle}"))
    sp.signal(signal.SIGUSR1)
    await asyncio.sleep(0.3)
    await post()
    assert await wait_until(lambda: log.exists() and log.read_text().count("\n") == 1)
    reloads = await metric_samples(sp.url, "specroute_config_reloads_total")
    assert set(reloads.values()) == {0.0}
    policy = await metric_samples(sp.url, "specroute_policy_reloads_total")
    assert set(policy.values()) == {0.0}
    sp.signal(signal.SIGTERM)
    assert await sp.wait() == 0


async def test_admin_reload_of_the_running_policy_keeps_it_and_another_starts_fresh(
    proxy, fake_backend, caplog
):
    base, eagle = await fake_backend(), await fake_backend()
    token = "admin-token-for-state"
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="cost_model", profile="kimi-k25-int4-8gpu",
        admin_token=token,
    )  # fmt: skip
    running = p.app[FORWARDER].policy
    _teach(running)
    headers = {"Authorization": f"Bearer {token}"}

    async def post(body: dict[str, Any]) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(p.url + "/admin/policy", json=body, headers=headers) as r,
        ):
            assert r.status == 200
            answer: dict[str, Any] = await r.json()
            return answer

    # the defaults spelled out are the running policy: kept, with what it learned
    answer = await post({"name": "cost_model", "params": {"calibrate": True, "scope": "system"}})
    assert p.app[FORWARDER].policy is running
    assert answer["learned"]["calibration"]["eagle"]["outcomes"] == 80
    with caplog.at_level(logging.WARNING, "specroute.admin"):
        answer = await post({"name": "cost_model:calibration_window=100"})
    assert p.app[FORWARDER].policy is not running
    assert answer["learned"]["calibration"]["eagle"]["outcomes"] == 0
    assert "starts with nothing learned; what cost_model had learned is dropped" in caplog.text
    reloads = await metric_samples(p.url, "specroute_policy_reloads_total")
    assert {tuple(v for _, v in k): n for k, n in reloads.items() if n} == {
        ("kept", "admin"): 1, ("reset", "admin"): 1,
    }  # fmt: skip


class NotPlainState:
    """Test plugin: a learner whose state is not plain data (NaN)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, params: NotPlainState.Params, context: PolicyContext) -> None:
        self.name = "not_plain"
        self.rng = random.Random(context.seed)

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        return route(view, "baseline", "fixed", self.rng, policy=self.name)

    def observe(self, outcome: Outcome) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {"version": 1, "scale": math.nan}

    def load_state(self, state: Any) -> None:
        pass


async def test_a_state_that_cannot_be_encoded_is_not_saved(proxy, fake_backend, tmp_path, caplog):
    path = tmp_path / "state.json"
    path.write_text("the old file")
    base = await fake_backend()
    p = await proxy(baseline=[base.url], policy=f"{__name__}:NotPlainState", state_file=str(path))
    with caplog.at_level(logging.ERROR, "specroute.state"):
        assert await _keeper_of(p.app).save() == "unencodable"
    assert "the state cannot be encoded" in caplog.text
    assert path.read_text() == "the old file"
