"""Three real `specroute serve` replicas in front of the same two emulated SGLang servers.

Clients (the official openai SDK) spread their requests over the replicas, as a Kubernetes
Service would. Every request is answered and routed; each replica's accounting returns to
zero; the decision logs record every decision, and show that the replicas saw each other's
load through the backends' counters (scraped) and not only their own requests; the emulators
never run more requests than the clients sent and end idle.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
from helpers import assert_in_flight_zero, emulator_running, metric_samples

PROFILE = "kimi-k25-int4-8gpu"
REPLICAS = 3
CLIENTS = 12
PER_CLIENT = 6
MAX_TOKENS = 24


async def test_three_replicas_share_two_emulators(emulator, spawn_serve, tmp_path: Path) -> None:
    base = await emulator("baseline", time_scale=0.2)
    eagle = await emulator("eagle", time_scale=0.2)
    logs = [tmp_path / f"decisions-{i}.jsonl" for i in range(REPLICAS)]
    replicas = []
    for log in logs:
        args = ["--baseline", base.url, "--eagle", eagle.url, "--profile", PROFILE, "--policy", "cost_model",
                "--replicas", str(REPLICAS), "--scrape-interval-s", "0.1", "--decision-log", str(log),
                "--log-level", "WARNING"]  # fmt: skip
        replicas.append(await spawn_serve(*args, stderr=asyncio.subprocess.DEVNULL))
    clients = [
        openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="k", max_retries=0, timeout=60) for r in replicas
    ]
    served: list[list[str]] = [[] for _ in replicas]
    busy: list[int] = []

    async def client(k: int) -> None:
        for j in range(PER_CLIENT):
            which = (k + j) % REPLICAS  # spread over the replicas, as a Service does
            raw = await clients[which].chat.completions.with_raw_response.create(
                model="m",
                messages=[{"role": "user", "content": f"client {k} request {j}"}],
                max_tokens=MAX_TOKENS,
                extra_body={"ignore_eos": True},
            )
            answer = raw.parse()
            assert answer.usage is not None and answer.usage.completion_tokens == MAX_TOKENS
            served[which].append(raw.headers["x-specroute-pool"])

    async def watch() -> None:
        # The two emulators are read one after the other, so a request that ends on the plain one
        # while the client's next one starts on the eagle one could be counted on both: the plain
        # one is read again after the eagle one, and the smaller of its two counts is taken.
        while True:
            first = await emulator_running(base.url)
            on_eagle = await emulator_running(eagle.url)
            again = await emulator_running(base.url)
            busy.append(min(first, again) + on_eagle)
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*(client(k) for k in range(CLIENTS)))
    finally:
        watcher.cancel()
        for c in clients:
            await c.close()

    total = CLIENTS * PER_CLIENT
    assert sum(len(s) for s in served) == total
    assert all(set(s) <= {"baseline", "eagle"} and len(s) == total // REPLICAS for s in served)
    assert busy and max(busy) <= CLIENTS  # the emulators never ran more than the clients sent
    for r, pools in zip(replicas, served, strict=True):
        await assert_in_flight_zero(r.url)
        requests = await metric_samples(r.url, "specroute_requests_total")
        per_pool = {p: sum(v for k, v in requests.items() if ("pool", p) in k) for p in ("baseline", "eagle")}
        assert per_pool == {p: float(pools.count(p)) for p in ("baseline", "eagle")}
        decisions = await metric_samples(r.url, "specroute_decisions_total")
        assert sum(decisions.values()) == len(pools)
    assert await emulator_running(base.url) == 0 and await emulator_running(eagle.url) == 0

    for r in replicas:
        r.signal()
        assert await r.wait() == 0  # drains and flushes its decision log
    saw_others = 0
    for log, pools in zip(logs, served, strict=True):
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert sorted(rec["pool"] for rec in lines) == sorted(pools)
        assert all(rec["status"] == "ok" and rec["policy"] == "cost_model" for rec in lines)
        # a decision that saw more requests on a pool than this replica had in flight there:
        # the others' requests, through the backends' scraped counts
        saw_others += any(
            rec["load"][p]["scraped"] is not None and rec["load"][p]["scraped"] > rec["load"][p]["in_flight"]
            for rec in lines
            for p in ("baseline", "eagle")
        )
    assert saw_others >= 1
