"""`specroute bench --prompts FILE` with a `category` per line, against an emulated EAGLE server
whose acceptance follows content rules: per category accept length and decode speed with 95%
CIs, and the categories written as priors into the eagle profile, which cost_model uses."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web
from helpers import run_specroute, serve_app

from controller.bench.categories import by_category, category_factors
from controller.bench.prompts import PromptError, load_prompts
from controller.bench.result import BenchResult, LevelResult, RequestResult, summarize
from policies.base import BackendLoad, LoadView, PoolLoad, RequestInfo
from policies.profile import load_profile, resolve_profile
from policies.registry import PolicyContext, default_registry
from simulator.emulator.accept_rules import parse_accept_rules
from simulator.emulator.app import EmulatorConfig, run_emulator

KIMI = resolve_profile("kimi-k25-int4-8gpu")
pytestmark = pytest.mark.timeout(180)


def prompt_file(path: Path) -> Path:
    lines = []
    for i in range(6):
        lines.append(
            {"category": "code", "messages": [{"role": "user", "content": f"def f{i}(x): complete it"}]}
        )
        lines.append(
            {"category": "prose", "messages": [{"role": "user", "content": f"A poem about tide {i}"}]}
        )
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


async def test_bench_reports_categories_and_writes_priors(tmp_path: Path) -> None:
    rules = parse_accept_rules([{"match": "def ", "factor": 1.4}, {"match": "poem", "factor": 0.6}])
    config = EmulatorConfig(mode="eagle", profile=KIMI, time_scale=0.02, accept_rules=rules)
    out, prof = tmp_path / "r.json", tmp_path / "eagle.json"
    async with run_emulator(config) as srv:
        code, stdout, stderr = await run_specroute(
            "bench", srv.url, "--prompts", str(prompt_file(tmp_path / "p.jsonl")), "--concurrency", "1", "4",
            "--requests-per-level", "24", "--warmup-requests", "2", "--max-tokens", "120", "--ignore-eos",
            "--out", str(out), "--profile-out", str(prof), "--mode", "eagle", "--no-progress", timeout_s=150,
        )  # fmt: skip
    assert code == 0, stderr
    assert "per category" in stdout and "code" in stdout and "prose" in stdout
    cats = {c["category"]: c for c in json.loads(out.read_text())["metadata"]["categories"]}
    assert cats["code"]["n"] == cats["prose"]["n"] == 24  # half of 2 x 24 measured requests each
    code_accept, prose_accept = cats["code"]["accept_length"], cats["prose"]["accept_length"]
    assert code_accept["mean"] == pytest.approx(1.4 * 2.4, rel=0.1)
    assert prose_accept["mean"] == pytest.approx(0.6 * 2.4, rel=0.1)
    assert code_accept["half_width"] > 0 and cats["code"]["decode_tok_s"]["half_width"] > 0
    # acceptance is speed: code decodes faster than prose on the same server
    assert cats["code"]["decode_tok_s"]["mean"] > 1.5 * cats["prose"]["decode_tok_s"]["mean"]
    # the profile's eagle mode carries the categories, relative to its accept length
    eagle = load_profile(prof).mode("eagle")
    assert eagle.categories is not None and eagle.accept_length is not None
    assert eagle.categories["code"] / eagle.categories["prose"] == pytest.approx(1.4 / 0.6, rel=0.15)
    # ... and cost_model takes them as the priors of requests hinted with the category
    merged = KIMI.model_copy(update={"modes": {**KIMI.modes, "eagle": KIMI.modes["eagle"].model_copy(
        update={"categories": eagle.categories})}})  # fmt: skip
    policy = default_registry(entry_points=False).create("cost_model", {}, PolicyContext(merged, 0))
    view = LoadView(
        PoolLoad("baseline", (BackendLoad("b", "baseline", running=3, queued=0),)),
        PoolLoad("eagle", (BackendLoad("e", "eagle", running=3, queued=0),)),
    )
    code_e2e = policy.choose(RequestInfo(max_tokens=100, hint="code"), view, 0.0).predicted_e2e_s["eagle"]
    prose_e2e = policy.choose(RequestInfo(max_tokens=100, hint="prose"), view, 0.0).predicted_e2e_s["eagle"]
    assert prose_e2e > 1.5 * code_e2e


def vllm_like(per_request: bool) -> web.Application:
    """A vLLM-like server: its /metrics counts accepted and drafted tokens (10 drafts a request,
    accept length 4 for code, 2 for prose); with `per_request` (vLLM's
    --per-request-spec-decode-metrics) its usage chunk carries each request's figures too."""
    counters = {"accepted": 0.0, "drafts": 0.0}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text = body["messages"][-1]["content"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body["max_tokens"])
        for i in range(n):
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        accepted = 10 * (3 if "def " in text else 1)
        usage: dict[str, object] = {
            "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": n + 9}
        }  # fmt: skip
        if per_request:
            stats = {"num_spec_steps": 10, "num_accepted_draft_tokens": accepted, "num_spec_tokens": 4}
            usage["metrics"] = {"speculative_decoding": stats}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        counters["drafts"] += 10
        counters["accepted"] += accepted
        return resp

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=(
            'vllm:num_requests_running{engine="0"} 0\nvllm:num_requests_waiting{engine="0"} 0\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {counters["accepted"]}\n'
            f'vllm:spec_decode_num_drafts_total{{engine="0"}} {counters["drafts"]}\n'
        ))  # fmt: skip

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    return app


@pytest.mark.parametrize("per_request", [False, True])
async def test_a_vllm_server_gets_accept_lengths_per_request_or_from_its_counters(
    tmp_path: Path, per_request: bool
) -> None:
    out, prof = tmp_path / "r.json", tmp_path / "eagle.json"
    async with serve_app(vllm_like(per_request)) as url:
        code, stdout, stderr = await run_specroute(
            "bench", url, "--prompts", str(prompt_file(tmp_path / "p.jsonl")), "--concurrency", "2",
            "--requests-per-level", "12", "--warmup-requests", "0", "--max-tokens", "16", "--out", str(out),
            "--profile-out", str(prof), "--mode", "eagle", "--no-progress",
        )  # fmt: skip
    assert code == 0, stderr
    meta = json.loads(out.read_text())["metadata"]
    cats = {c["category"]: c for c in meta["categories"]}
    if per_request:  # each request's own figure: no probe after the sweep
        assert "category_probe" not in meta and "probe" not in stdout
        assert cats["code"]["accept_length"]["n"] == cats["prose"]["accept_length"]["n"] == 6
    else:
        assert "counters around each of the probe's requests" in stdout
        assert {c: len(v) for c, v in meta["category_probe"].items()} == {"code": 8, "prose": 8}
    assert cats["code"]["accept_length"]["mean"] == pytest.approx(4.0)
    assert cats["prose"]["accept_length"]["mean"] == pytest.approx(2.0)
    # relative to the sweep's own accept length (about half code, half prose with the filler: ~3),
    # which the probe after it does not move
    eagle = load_profile(prof).mode("eagle")
    assert eagle.accept_length is not None and eagle.accept_length == pytest.approx(3.0, rel=0.05)
    assert eagle.categories == pytest.approx(
        {"code": 4 / eagle.accept_length, "prose": 2 / eagle.accept_length}, rel=1e-3
    )
    # the draft depth the adaptive-server model scales from: each request's num_spec_tokens; the
    # counters alone do not say it
    assert eagle.speculative_num_steps == (4 if per_request else None)


def stepping_vllm(step_s: float) -> web.Application:
    """A vLLM-like EAGLE server whose speed follows acceptance, as a real one's does: one verify
    step of `step_s` seconds yields 4 tokens of code (accept length 4) or 2 of prose, streamed as
    one chunk a step; each usage chunk carries the request's own figures."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        accept = 4 if "def " in body["messages"][-1]["content"] else 2
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body["max_tokens"])
        for step in range(n // accept):
            await asyncio.sleep(step_s)
            text = "".join(f"t{step * accept + k} " for k in range(accept))
            chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        steps = n // accept
        stats = {
            "num_spec_steps": steps,
            "num_accepted_draft_tokens": steps * (accept - 1),
            "num_spec_tokens": 3,
        }
        usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": n + 9},
                 "metrics": {"speculative_decoding": stats}}  # fmt: skip
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


async def test_the_eagle_profile_speed_is_what_the_category_factors_scale(tmp_path: Path) -> None:
    """Code (accept length 4) decodes twice as fast as prose (2); with twice as much code as prose
    the median request is a code one, yet a request of each category is predicted at the profile's
    speed times its factor: the profile stores the speed the factors scale."""
    lines = [
        {"category": "code" if i % 3 else "prose",
         "messages": [{"role": "user", "content": f"def f{i}(x):" if i % 3 else f"A poem about tide {i}"}]}
        for i in range(12)
    ]  # fmt: skip
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out, prof = tmp_path / "r.json", tmp_path / "eagle.json"
    async with serve_app(stepping_vllm(0.01)) as url:
        code, _, stderr = await run_specroute(
            "bench", url, "--prompts", str(prompts), "--concurrency", "1", "--requests-per-level", "24",
            "--warmup-requests", "0", "--max-tokens", "32", "--out", str(out), "--profile-out", str(prof),
            "--mode", "eagle", "--no-progress",
        )  # fmt: skip
    assert code == 0, stderr
    cats = {c["category"]: c for c in json.loads(out.read_text())["metadata"]["categories"]}
    assert cats["code"]["n"] == 16 and cats["prose"]["n"] == 8
    measured = {c: cats[c]["decode_tok_s"]["mean"] for c in ("code", "prose")}
    assert measured["code"] > 1.6 * measured["prose"]
    eagle = load_profile(prof).mode("eagle")
    # no counters on its /metrics (as through specroute): the requests' own accept lengths
    assert eagle.accept_length == pytest.approx((16 * 4 + 8 * 2) / 24, rel=1e-3)
    assert eagle.accept_length is not None and eagle.categories is not None
    assert eagle.categories == pytest.approx(
        {"code": 4 / eagle.accept_length, "prose": 2 / eagle.accept_length}, rel=1e-3
    )
    speed = eagle.points[0].decode_tok_s
    for category in ("code", "prose"):
        assert speed * eagle.categories[category] == pytest.approx(measured[category], rel=0.1)
    # the plain median of the mix is a code request's speed: what the point is not
    assert speed < 0.9 * measured["code"]


def test_category_summaries_and_factors() -> None:
    reqs = [
        RequestResult("measured", 0.0, 0.1, 0.1, 1.1, 1.2, 11, category=c, accept_length=a)
        for c, a in [("a", 3.0), ("a", 3.2), ("b", 1.5), ("b", 1.7), (None, 2.0)]
    ]
    reqs.append(RequestResult("warmup", 0.0, 0.1, 0.1, 1.1, 1.2, 11, category="a", accept_length=9.0))
    level = LevelResult(concurrency=1, requests=reqs, summary=summarize(1, reqs))
    summaries = by_category([level])
    assert [(s.category, s.n) for s in summaries] == [("a", 2), ("b", 2)]
    assert summaries[0].accept_length is not None and summaries[0].accept_length.mean == pytest.approx(3.1)
    assert category_factors(summaries, 2.0) == {"a": 1.55, "b": 0.8}
    assert category_factors(summaries, None) == {
        "a": pytest.approx(3.1 / 2.35, abs=1e-4),
        "b": pytest.approx(1.6 / 2.35, abs=1e-4),
    }
    # old result files (no category fields) still read
    doc = BenchResult(metadata={}, levels=[level]).to_json()
    for lv in doc["levels"]:
        for r in lv["requests"]:
            r.pop("category"), r.pop("accept_length")
    assert BenchResult.from_json(doc).levels[0].requests[0].category is None


def test_a_bad_category_is_named(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"category": 3, "prompt": "x"}\n')
    with pytest.raises(PromptError, match="'category' must be a string"):
        load_prompts(path)
