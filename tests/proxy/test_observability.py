"""Observability (issue 7), end to end on 127.0.0.1: `/metrics` under traffic (promtool and
prometheus_client's parser), backend load scraped from emulated and fake SGLang servers (it moves
the threshold policy; stale samples are ignored), the decision log (fields, no text, rotation,
replay in the simulator) and shadow policies (counted, logged, learning, never routing)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from helpers import make_tracker, run_command, run_specroute, wait_until
from prometheus_client.parser import text_string_to_metric_families

from controller.proxy.app import FORWARDER, SCRAPER
from controller.proxy.config import Settings
from controller.proxy.core import policy_context
from controller.proxy.decision_log import DecisionLog
from policies.base import Decision, LoadView, Outcome, Policy, RequestInfo
from policies.registry import default_registry

ROOT = Path(__file__).resolve().parents[2]
PROFILE = "kimi-k25-int4-8gpu"
SECRET = "SECRET-PROMPT-zebra-quartz"
CHAT = [{"role": "user", "content": f"{SECRET} write a haiku about routers"}]

PUBLIC_METRICS = {
    "specroute_requests": "counter",
    "specroute_in_flight_requests": "gauge",
    "specroute_decisions": "counter",
    "specroute_ttft_seconds": "histogram",
    "specroute_request_duration_seconds": "histogram",
    "specroute_output_tokens": "counter",
    "specroute_decode_tokens_per_second": "histogram",
    "specroute_prediction_ratio": "histogram",
    "specroute_backend_healthy": "gauge",
    "specroute_backend_running_requests": "gauge",
    "specroute_backend_queued_requests": "gauge",
    "specroute_backend_spec_accept_length": "gauge",
    "specroute_proxy_overhead_seconds": "histogram",
    "specroute_shadow_decisions": "counter",
    "specroute_accept_factor_ratio": "histogram",
    "specroute_acceptance_families": "gauge",
    "specroute_exploration_share": "gauge",
    "specroute_exploration_budget_spent_ratio": "gauge",
    "specroute_exploration_regret_seconds": "gauge",
}
LOG_FIELDS = {
    "ts", "endpoint", "stream", "prompt_tokens", "max_tokens", "hint", "forced_pool", "load", "policy",
    "pool", "backend", "reason", "chosen_pool", "chosen_backend", "predicted_ttft_s", "predicted_e2e_s",
    "ttft_s", "completion_tokens", "duration_s", "status", "http_status", "shadow",
    "believed_cached_tokens", "cached_tokens", "accept_factor_predicted", "accept_factor_reported",
    "sequences", "client_blocked_s",
}  # fmt: skip


def sglang_metrics(running: int, queued: int = 0, accept: float | None = None) -> str:
    """SGLang-shaped scheduler gauges (two tensor-parallel ranks reporting the same state)."""
    lines = []
    gauges: list[tuple[str, float]] = [("num_running_reqs", running), ("num_queue_reqs", queued)]
    if accept is not None:
        gauges.append(("spec_accept_length", accept))
    for name, value in gauges:
        lines += [f"# HELP sglang:{name} {name}", f"# TYPE sglang:{name} gauge"]
        for tp in (0, 1):
            labels = f'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="{tp}"'
            lines.append(f"sglang:{name}{{{labels}}} {float(value)}")
    return "\n".join(lines) + "\n"


class ManualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


async def chat(
    client: openai.AsyncOpenAI, *, stream: bool, max_tokens: int = 8, headers: dict[str, str] | None = None
) -> str:
    """One request; returns the pool that served it."""
    kw: dict[str, Any] = {"model": "m", "messages": CHAT, "max_tokens": max_tokens, "extra_headers": headers}
    if stream:
        kw["stream_options"] = {"include_usage": True}
    raw = await client.chat.completions.with_raw_response.create(stream=stream, **kw)
    body = raw.parse()
    if stream:
        async for _ in body:  # type: ignore[union-attr]
            pass
    return raw.headers["x-specroute-pool"]


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


# --- /metrics ------------------------------------------------------------------------------


async def test_metrics_under_traffic_pass_promtool_and_parse(fake_backend, proxy):
    base = await fake_backend(name="base", delay_s=0.005)
    eagle = await fake_backend(name="eagle", delay_s=0.005)
    base.metrics_text = sglang_metrics(1)
    eagle.metrics_text = sglang_metrics(2, 1, accept=2.6)
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="cost_model", profile=PROFILE, scrape_interval_s=0.05,
        shadow_policies=[{"name": "threshold", "params": {"threshold": 1}}], health_check_interval_s=60,
        allow_client_override=True,
    )  # fmt: skip
    assert await wait_until(lambda: all(b.sample_time is not None for b in p.tracker))
    client = p.client()
    for i in range(6):
        await chat(client, stream=i % 3 != 0, headers={"x-specroute-hint": "code"})
    await chat(client, stream=True, headers={"x-specroute-mode": "eagle"})
    await client.close()
    async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/chat/completions", data=b"{") as r:
        assert r.status == 400
    text = await p.metrics_text()

    found = families(text)
    for name, kind in PUBLIC_METRICS.items():
        assert name in found, f"{name} missing from /metrics"
        assert found[name].type == kind, name
    for family in found.values():  # bounded labels: never a prompt, an id or free text
        for s in family.samples:
            assert SECRET not in str(s.labels)
            assert set(s.labels) <= {
                "pool",
                "backend",
                "status",
                "policy",
                "reason",
                "agrees",
                "code",
                "le",
                "source",
                "learned",
            }

    def value(name: str, **labels: str) -> float | None:
        return p.metrics.get_sample_value(name, labels)

    def both_pools(name: str, **labels: str) -> float:
        return sum(value(name, pool=pool, **labels) or 0.0 for pool in ("baseline", "eagle"))

    assert value("specroute_requests_total", pool="eagle", backend=eagle.url, status="ok") is not None
    assert value("specroute_backend_running_requests", pool="eagle", backend=eagle.url) == 2
    assert value("specroute_backend_queued_requests", pool="eagle", backend=eagle.url) == 1
    assert value("specroute_backend_spec_accept_length", pool="eagle", backend=eagle.url) == 2.6
    assert value("specroute_backend_spec_accept_length", pool="baseline", backend=base.url) is None
    assert both_pools("specroute_output_tokens_total") == 7 * 8
    assert both_pools("specroute_request_duration_seconds_count") == 7
    assert both_pools("specroute_ttft_seconds_count") == 5  # non-streaming answers: no first event
    assert both_pools("specroute_decode_tokens_per_second_count") == 5
    # cost_model predicts both pools: every routed (not forced) ok request has a ratio
    assert both_pools("specroute_prediction_ratio_count", policy="cost_model") == 6
    assert value("specroute_proxy_overhead_seconds_count") == 7
    shadow = sum(s.value for s in found["specroute_shadow_decisions"].samples if s.name.endswith("_total"))
    assert shadow == 7

    def bounds(name: str) -> list[float]:
        les = {float(s.labels["le"]) for s in found[name].samples if "le" in s.labels}
        return sorted(les - {float("inf")})

    # buckets fit LLM serving
    assert bounds("specroute_ttft_seconds")[0] == 0.01 and bounds("specroute_ttft_seconds")[-1] == 60
    assert bounds("specroute_request_duration_seconds")[-1] == 600
    # the help says what is measured: from the decision, as Outcome.ttft_s/duration_s (not arrival)
    for name in ("specroute_ttft_seconds", "specroute_request_duration_seconds"):
        assert found[name].documentation.startswith("Time from the routing decision"), name
    rate = bounds("specroute_decode_tokens_per_second")
    assert rate[0] == 1 and rate[-1] == 1000

    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is required in CI (.ci/run installs Debian's prometheus package)")
        pytest.skip("promtool not installed")
    code, out, err = await run_command(promtool, "check", "metrics", stdin=text)
    assert code == 0, out + err


# --- live backend load -----------------------------------------------------------------------


async def test_emulated_backend_load_from_other_clients_moves_the_threshold_policy(emulator, proxy):
    base = await emulator("baseline", time_scale=1.0)
    eagle = await emulator("eagle", time_scale=1.0)
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="threshold",
        policy_params={"threshold": 4, "signal": "max"}, scrape_interval_s=0.05, health_check_interval_s=60,
    )  # fmt: skip
    assert await wait_until(lambda: p.tracker.get(eagle.url).sample_time is not None)
    client = p.client()
    assert await chat(client, stream=True) == "eagle"  # idle: below the threshold

    # Five requests another proxy replica (or a client going direct) sent to the eagle server.
    async with aiohttp.ClientSession() as session:
        direct = []
        for _ in range(5):
            body = {"model": "m", "messages": CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
            resp = await session.post(eagle.url + "/v1/chat/completions", json=body)
            await resp.content.readany()  # first event: the request is running
            direct.append(resp)
        assert await wait_until(lambda: p.tracker.get(eagle.url).running == 5)

        view = p.tracker.view(p.forwarder.clock())
        (e,) = view.eagle.backends
        assert (e.in_flight, e.running, e.queued, e.load) == (0, 5, 0, 5)
        assert e.sample_age_s is not None and e.sample_age_s >= 0  # fresh: a stale one has no counts
        assert await chat(client, stream=True) == "baseline"  # 5 >= threshold 4
        text = await p.metrics_text()
        assert f'specroute_backend_running_requests{{backend="{eagle.url}",pool="eagle"}} 5.0' in text
        assert 'reason="above_threshold"' in text

        for resp in direct:
            resp.close()
    assert await wait_until(lambda: p.tracker.get(eagle.url).running == 0)
    assert await chat(client, stream=True) == "eagle"
    await client.close()


async def test_stale_sample_is_ignored(fake_backend, proxy):
    base, eagle = await fake_backend(name="base"), await fake_backend(name="eagle")
    eagle.metrics_text = sglang_metrics(50)
    clock = ManualClock()
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="threshold", policy_params={"threshold": 8},
        clock=clock, health_check_interval_s=60, scrape_interval_s=3600,  # one scrape at start, then none
    )  # fmt: skip
    assert await wait_until(lambda: p.tracker.get(eagle.url).sample_time is not None)
    assert p.tracker.view(clock()).eagle.backends[0].load == 50
    client = p.client()
    assert await chat(client, stream=True) == "baseline"
    labels = {"pool": "eagle", "backend": eagle.url}
    assert p.metrics.get_sample_value("specroute_backend_running_requests", labels) == 50

    clock.now += 5.5  # older than scrape_stale_after_s (default 5 s)
    b = p.tracker.view(clock()).eagle.backends[0]
    assert (b.running, b.queued, b.sample_age_s, b.load) == (None, None, None, 0)
    assert await chat(client, stream=True) == "eagle"
    await client.close()
    assert p.metrics.get_sample_value("specroute_backend_running_requests", labels) is None
    assert p.metrics.get_sample_value("specroute_backend_sample_age_seconds", labels) == 5.5


def test_sample_is_combined_with_this_replicas_traffic_since_it_was_taken():
    t = make_tracker(["http://b:1"], ["http://e:1"], stale_after_s=5.0)
    e = "http://e:1"
    mine = [t.reserve(e) for _ in range(2)]
    # The backend reports 6 running + 3 queued, our 2 included (others sent the remaining 7).
    t.record_sample(e, 6, 3, taken_at=10.0, in_flight_at_sample=2, accept_length=2.5)
    first = t.view(10.0).eagle.backends[0]
    assert (first.in_flight, first.running, first.queued, first.load) == (2, 6, 3, 9)
    later = [t.reserve(e) for _ in range(3)]  # dispatched since the sample: not in it yet
    t.release(mine[0])  # finished since the sample
    b = t.view(11.0).eagle.backends[0]
    assert (b.in_flight, b.running, b.queued, b.scraped, b.load, b.sample_age_s) == (4, 8, 3, 11, 11, 1.0)
    for r in [mine[1], *later]:
        t.release(r)
    b = t.view(11.0).eagle.backends[0]  # everything of ours left; the others' 7 remain
    assert (b.in_flight, b.running, b.queued, b.load) == (0, 4, 3, 7)
    t.record_sample(e, 0, 0, taken_at=12.0, in_flight_at_sample=0)
    t.release(t.reserve(e))
    assert t.view(12.0).eagle.backends[0].load == 0  # never below zero
    assert t.view(17.5).eagle.backends[0].running is None  # stale


async def test_backend_without_metrics_works_on_local_counts_with_one_warning(fake_backend, proxy, caplog):
    base = await fake_backend(name="base")  # /metrics without SGLang gauges, no /v1/loads
    caplog.set_level("WARNING", logger="specroute.scrape")
    p = await proxy(baseline=[base.url], policy="fixed", scrape_interval_s=0.02, health_check_interval_s=60)
    assert await wait_until(lambda: p.app[SCRAPER].scrapers[base.url].has_metrics is False)
    await asyncio.sleep(0.2)  # several more rounds
    client = p.client()
    assert await chat(client, stream=False) == "baseline"
    await client.close()
    warnings = [r for r in caplog.records if "exports no load metrics" in r.getMessage()]
    assert len(warnings) == 1 and base.url in warnings[0].getMessage()
    assert p.tracker.get(base.url).sample_time is None


# --- decision log and shadow policies ---------------------------------------------------------


class ExplodingPolicy:
    name = "exploding"

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        raise RuntimeError("boom")

    def observe(self, outcome: Outcome) -> None:
        raise RuntimeError("boom")


async def test_decision_log_fields_no_text_and_simulator_replay(fake_backend, proxy, tmp_path):
    base = await fake_backend(name="base", delay_s=0.002)
    eagle = await fake_backend(name="eagle", delay_s=0.002)
    log = tmp_path / "logs" / "decisions.jsonl"
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="cost_model", profile=PROFILE, decision_log=str(log),
        shadow_policies=[
            {"name": "fixed", "params": {"pool": "eagle"}, "label": "always-eagle"},
            {"name": "online", "params": {"epsilon": 0.0}},
        ],
        health_check_interval_s=60, allow_client_override=True,
    )  # fmt: skip
    client = p.client()
    for i in range(8):
        await chat(client, stream=i % 2 == 0, max_tokens=4 + i, headers={"x-specroute-hint": "code"})
    await chat(client, stream=True, headers={"x-specroute-mode": "baseline", "x-specroute-hint": "code"})
    await client.close()
    online = next(pol for label, pol in p.app[FORWARDER].shadows.policies if label == "online")
    assert online.state()  # it observed the real outcomes while in shadow
    await p.stop()  # drains the writer thread

    text = log.read_text()
    assert SECRET not in text and "haiku" not in text and "tok0" not in text  # no prompt, no answer
    lines = [json.loads(line) for line in text.splitlines()]
    assert len(lines) == 9
    for rec in lines:
        assert set(rec) == LOG_FIELDS
        assert rec["status"] == "ok" and rec["http_status"] == 200 and rec["policy"] == "cost_model"
        assert rec["endpoint"] == "chat" and rec["hint"] == "code"
        assert set(rec["load"]) == {"baseline", "eagle"}
        assert rec["load"]["eagle"]["backends"] == 1
        assert rec["backend"] in (base.url, eagle.url) and rec["pool"] == rec["chosen_pool"]
        assert rec["duration_s"] >= 0 and 1.6e9 < rec["ts"] < 4.1e9  # wall-clock epoch seconds
        assert [s["policy"] for s in rec["shadow"]] == ["always-eagle", "online"]
    routed = [r for r in lines if r["forced_pool"] is None]
    assert {r["max_tokens"] for r in routed} == set(range(4, 12))
    assert all(set(r["predicted_e2e_s"]) == {"baseline", "eagle"} for r in routed)
    assert all(r["completion_tokens"] == min(r["max_tokens"], 8) for r in routed)  # the fake sends <= 8
    assert [r["ttft_s"] is not None for r in routed].count(True) == 4  # the streamed ones
    assert all(r["shadow"][0]["pool"] == "eagle" for r in routed)
    # content-aware cost_model: the eagle factor it used (nothing learned yet: the pool average,
    # the hint's); the fake backend reports no accept length, so nothing is reported
    assert all(r["accept_factor_predicted"] > 0 for r in routed)
    assert all(r["accept_factor_reported"] is None for r in lines)
    assert all(set(r["shadow"][1]["predicted_e2e_s"]) == {"baseline", "eagle"} for r in routed)
    (forced,) = [r for r in lines if r["forced_pool"] is not None]
    assert (forced["pool"], forced["reason"]) == ("baseline", "client_override")
    assert forced["predicted_e2e_s"] == {}
    # the shadows see the same inputs, the forced pool included
    assert [(s["pool"], s["reason"]) for s in forced["shadow"]] == [("baseline", "client_override")] * 2

    # replayed as a trace; no --trace-format: the format is detected from the file
    simulate = ["simulate", "--profile", PROFILE, "--policy", "threshold", "--json"]
    code, out, err = await run_specroute(*simulate, "--workload", "trace", "--trace", str(log))
    assert code == 0, err
    assert json.loads(out)["runs"][0]["summary"]["requests"] == 9


async def test_shadow_policies_are_counted_and_never_change_routing(fake_backend, proxy, caplog):
    base, eagle = await fake_backend(name="base"), await fake_backend(name="eagle")
    caplog.set_level("ERROR", logger="specroute.shadow")
    registry = default_registry(entry_points=False)
    settings = Settings(baseline=[base.url], eagle=[eagle.url])
    ctx = policy_context(settings)
    shadows: list[tuple[str, Policy]] = [
        ("exploding", ExplodingPolicy()),
        ("to-eagle", registry.create("fixed", {"pool": "eagle"}, ctx)),
        ("threshold", registry.create("threshold", {"threshold": 1}, ctx)),
    ]
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="fixed", policy_params={"pool": "baseline"},
        shadows=shadows, health_check_interval_s=60,
    )  # fmt: skip
    client = p.client()
    pools = [await chat(client, stream=i % 2 == 0) for i in range(6)]
    await client.close()
    assert pools == ["baseline"] * 6
    assert len(base.requests) == 6 and eagle.requests == []

    def shadow(policy: str, pool: str, agrees: str) -> float | None:
        labels = {"policy": policy, "pool": pool, "agrees": agrees}
        return p.metrics.get_sample_value("specroute_shadow_decisions_total", labels)

    assert shadow("to-eagle", "eagle", "false") == 6
    assert shadow("threshold", "eagle", "false") == 6  # nothing in flight on eagle: below 1
    assert shadow("exploding", "baseline", "true") is None and shadow("exploding", "eagle", "false") is None
    decisions = {"policy": "fixed", "pool": "baseline", "reason": "fixed_baseline"}
    assert p.metrics.get_sample_value("specroute_decisions_total", decisions) == 6
    boom = [r for r in caplog.records if "exploding" in r.getMessage()]
    assert len(boom) == 2  # choose() and observe(), each logged once


# --- start-up errors and rotation -------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"SPECROUTE_SHADOW_POLICIES": '[{"name": "nope"}]'}, "shadow_policies[0]: unknown policy 'nope'"),
        ({"SPECROUTE_SHADOW_POLICIES": '[{"name": "fixed"}, {"name": "fixed"}]'}, "distinct `label`"),
        ({"SPECROUTE_DECISION_LOG": "/proc/specroute/decisions.jsonl"}, "decision_log /proc/specroute"),
    ],
)
def test_serve_rejects_bad_observability_settings(env, expected):
    full = {k: v for k, v in os.environ.items() if not k.startswith("SPECROUTE_")} | env
    proc = subprocess.run(
        [sys.executable, "-m", "controller.cli", "serve", "--port", "0", "--baseline", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60, env=full, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert expected in proc.stderr and "Traceback" not in proc.stderr


def test_decision_log_rotates_by_size(tmp_path):
    path = tmp_path / "d.jsonl"
    dlog = DecisionLog(path, max_bytes=400, backups=2, transform=lambda i: {"i": i, "pad": "x" * 40})
    for i in range(40):
        dlog.write(i)
    dlog.close()
    files = [path, path.with_name("d.jsonl.1"), path.with_name("d.jsonl.2")]
    assert all(f.exists() for f in files) and not path.with_name("d.jsonl.3").exists()
    assert all(f.stat().st_size <= 400 for f in files)
    kept = [json.loads(line)["i"] for f in reversed(files) for line in f.read_text().splitlines()]
    assert kept == list(range(40 - len(kept), 40))  # the newest records, in order
