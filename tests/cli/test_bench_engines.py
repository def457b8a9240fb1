"""`specroute bench` against streams shaped like vLLM's: empty-content chunks (a UTF-8 sequence
not yet complete), reasoning as `delta.reasoning`, a small context; and the result it reports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from helpers import run_specroute, serve_app

from controller.bench.prefill import fit_lengths
from controller.bench.runner import run_sweep
from policies.base import POOLS
from policies.profile import load_profile, parse_profile

pytestmark = pytest.mark.timeout(180)

SPEED = 80.0
"""The emulator's decode rate (tok/s per request) at any concurrency: one flat profile point."""


def flat_profile(speed: float = SPEED) -> Any:
    return parse_profile(
        {
            "format": "specroute.profile/v1",
            "name": "flat",
            "modes": {
                "baseline": {"max_running_requests": 8, "points": [{"concurrency": 1, "decode_tok_s": speed}]}
            },
        }
    )


@pytest.mark.parametrize(
    ("endpoint", "reasoning"),
    [("chat", 12), ("chat", 1000), ("completions", 0)],
    ids=["reasoning-then-content", "all-reasoning", "completions"],
)
async def test_bench_of_empty_chunks_and_reasoning_deltas_is_the_configured_speed(
    emulator: Any, endpoint: str, reasoning: int
) -> None:
    # Every third chunk has empty text; chat answers start with (or are all) delta.reasoning.
    server = await emulator(
        profile=flat_profile(),
        time_scale=1.0,
        reasoning_tokens=reasoning,
        empty_chunk_every=3,
        output_tokens_cv=0,
    )
    result = await run_sweep(
        server.url, levels=(1,), requests_per_level=8, warmup=1, max_tokens=40, endpoint=endpoint,  # type: ignore[arg-type]
        ignore_eos=True,
    )  # fmt: skip
    level = result.levels[0]
    assert level.summary.errors == 0
    assert all(r.completion_tokens == 40 for r in level.requests if r.phase == "measured")
    decode = level.summary.decode_tok_s
    assert decode is not None and decode.n == 8
    assert decode.p50 == pytest.approx(SPEED, rel=0.05)
    assert decode.mean == pytest.approx(SPEED, rel=0.05)
    point = result.to_profile("baseline").mode("baseline").points[0]
    assert point.decode_tok_s == pytest.approx(SPEED, rel=0.05)


def test_prefill_lengths_fit_the_models_context() -> None:
    assert fit_lengths((1000, 4000, 16000), None) == (1000, 4000, 16000)
    assert fit_lengths((1000, 4000, 16000), 32768) == (1000, 4000, 16000)
    assert fit_lengths((100, 500, 16000), 1024) == (100, 500)
    assert fit_lengths((1000, 4000, 16000), 1024) == (120, 240, 480)


async def test_prefill_within_a_small_context_and_lengths_from_usage(emulator: Any, tmp_path: Path) -> None:
    server = await emulator(profile=flat_profile(), time_scale=0.05, max_model_len=1024)
    out = tmp_path / "run.json"
    code, _, stderr = await run_specroute(
        "bench", server.url, "--prefill", "--prefill-repeats", "2",
        "--concurrency", "1", "--requests-per-level", "2", "--warmup-requests", "0", "--max-tokens", "4",
        "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert code == 0, stderr
    prefill = json.loads(out.read_text())["metadata"]["prefill"]
    assert prefill["context_tokens"] == 1024 and prefill["lengths"] == [120, 240, 480]
    assert prefill["errors"] == 0, prefill["error_messages"]
    # Every prompt fits, and its length is near the one asked for once the probe set chars/token.
    counted = sorted(n for n, _ in prefill["points"])
    assert max(counted) < 1024 and prefill["chars_per_token"] > 0
    assert counted[0] == pytest.approx(120, rel=0.25) and counted[-1] == pytest.approx(480, rel=0.25)


async def test_prefill_failures_report_the_servers_message(tmp_path: Path) -> None:
    message = (
        "This model's maximum context length is 1024 tokens. However, your request has 1500 input tokens."
    )

    async def refuse(request: web.Request) -> web.Response:
        body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
        return web.json_response(body, status=400)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    app.router.add_get("/v1/models", models)
    async with serve_app(app) as url:
        _, stdout, stderr = await run_specroute(
            "bench", url, "--prefill", "--prefill-lengths", "100", "200", "--prefill-repeats", "1",
            "--concurrency", "1", "--requests-per-level", "1", "--warmup-requests", "0", "--no-progress",
            "--out", str(tmp_path / "run.json"),
        )  # fmt: skip
    assert "prefill not measured" in stdout + stderr
    assert "maximum context length is 1024 tokens" in stdout + stderr


def test_profile_from_a_vllm_sweep_records_the_engine_and_its_accept_length(tmp_path: Path) -> None:
    from controller.bench.result import BenchResult, LevelResult, RequestResult, summarize

    requests = [
        RequestResult(phase="measured", start_s=i, first_token_s=i + 0.1, last_token_s=i + 1.1, end_s=i + 1.2,
                      ttft_s=0.1, completion_tokens=101)
        for i in range(5)
    ] + [  # one burst: 101 tokens in 10 ms, a rate 100x the others
        RequestResult(phase="measured", start_s=9, first_token_s=9.1, last_token_s=9.11, end_s=9.2,
                      ttft_s=0.1, completion_tokens=101)
    ]  # fmt: skip
    result = BenchResult(
        metadata={
            "server_info": {"engine": "vllm", "spec_accepted_tokens": 1000.0, "spec_drafts": 500.0},
            "server_info_end": {"engine": "vllm", "spec_accepted_tokens": 4000.0, "spec_drafts": 1500.0,
                                "avg_spec_accept_length": 3.67},
        },
        levels=[LevelResult(1, requests, summarize(1, requests))],
    )  # fmt: skip
    profile = result.to_profile("eagle")
    path = tmp_path / "p.json"
    path.write_text(profile.model_dump_json())
    loaded = load_profile(str(path))
    mode = loaded.mode("eagle")
    assert mode.accept_length == pytest.approx(4.0)  # 3000 accepted over 1000 drafts in the sweep, + 1
    assert mode.points[0].decode_tok_s == pytest.approx(100.0)  # the median, not the burst-dragged mean
    assert (
        result.levels[0].summary.decode_tok_s is not None
        and result.levels[0].summary.decode_tok_s.mean > 1000
    )
    assert json.loads(path.read_text())["engine"] == "vllm"


async def test_bench_together_measures_both_servers_at_once(emulator: Any, tmp_path: Path) -> None:
    base = await emulator(profile=flat_profile(), time_scale=0.5)
    spec = await emulator(profile=flat_profile(SPEED * 2), time_scale=0.5)
    out, prof = tmp_path / "run.json", tmp_path / "pair.json"
    code, stdout, stderr = await run_specroute(
        "bench", base.url, "--together", spec.url, "--mode", "baseline", "--concurrency", "1", "2",
        "--requests-per-level", "4", "--warmup-requests", "1", "--max-tokens", "16", "--ignore-eos",
        "--out", str(out), "--profile-out", str(prof), "--no-progress",
    )  # fmt: skip
    assert code == 0, stderr
    assert f"together with {spec.url} (eagle)" in stdout
    first, second = json.loads(out.read_text()), json.loads((tmp_path / "run.together.json").read_text())
    assert (
        [lv["concurrency"] for lv in first["levels"]]
        == [1, 2]
        == [lv["concurrency"] for lv in second["levels"]]
    )
    assert first["metadata"]["together_with"] == spec.url and second["metadata"]["url"] == spec.url
    for a, b in zip(first["levels"], second["levels"], strict=True):
        assert a["summary"]["errors"] == b["summary"]["errors"] == 0
        # the faster server keeps sending fillers until the slower one's measured requests are done:
        # every measured request ran with both servers loaded (alone it would take half the time)
        slow_end = max(r["end_s"] for r in a["requests"] if r["phase"] == "measured")
        assert max(r["end_s"] for r in b["requests"]) >= 0.9 * slow_end
    profile = load_profile(str(prof))
    assert set(profile.modes) == {"baseline", "eagle"}
    fast = profile.mode("eagle").points[0].decode_tok_s
    slow = profile.mode("baseline").points[0].decode_tok_s
    # each server's own speed, measured side by side (the truth is 2x; the bounds are loose because
    # a busy machine adds the same delay to both servers' steps and pulls the ratio toward 1)
    assert 1.5 < fast / slow < 2.5


async def test_bench_together_in_rounds_interleaves_alone_and_together(emulator: Any, tmp_path: Path) -> None:
    base = await emulator(profile=flat_profile(), time_scale=0.5)
    spec = await emulator(profile=flat_profile(SPEED * 2), time_scale=0.5)
    out, prof = tmp_path / "run.json", tmp_path / "pair.json"
    code, stdout, stderr = await run_specroute(
        "bench", base.url, "--together", spec.url, "--mode", "baseline", "--rounds", "2",
        "--concurrency", "1", "--requests-per-level", "3", "--warmup-requests", "1", "--max-tokens", "16",
        "--ignore-eos", "--out", str(out), "--profile-out", str(prof), "--no-progress",
    )  # fmt: skip
    assert code == 0, stderr
    # the order of the runs: alone, alone, together, alone, alone, together, alone, alone
    runs = json.loads(out.read_text())["metadata"]["runs"]
    assert [(r["kind"], r["server"]) for r in runs] == [
        *[("alone", base.url), ("alone", spec.url), ("together", base.url), ("together", spec.url)] * 2,
        ("alone", base.url), ("alone", spec.url),
    ]  # fmt: skip
    files = {
        "together baseline": out, "together eagle": tmp_path / "run.together.json",
        "alone baseline": tmp_path / "run.alone.json", "alone eagle": tmp_path / "run.together.alone.json",
    }  # fmt: skip
    measured = {}
    for name, path in files.items():
        (level,) = json.loads(path.read_text())["levels"]
        measured[name] = [r for r in level["requests"] if r["phase"] == "measured"]
        assert level["summary"]["n"] == len(measured[name]) and level["summary"]["errors"] == 0
    # 2 together runs and 3 alone runs of 3 requests each, pooled
    assert {name: len(rs) for name, rs in measured.items()} == {
        "together baseline": 6, "together eagle": 6, "alone baseline": 9, "alone eagle": 9,
    }  # fmt: skip
    # pooled runs follow each other in time
    starts = [r["start_s"] for r in measured["alone baseline"]]
    assert starts == sorted(starts)
    # emulators do not share cores: together is as fast as alone, each round's factor near 1
    line = next(x for x in stdout.splitlines() if x.startswith("c=1: decode speed together / alone"))
    factors = [float(f) for f in re.findall(r"x(\d+\.\d+) \(n=2, rounds", line)]
    assert len(factors) == 2 and factors == pytest.approx([1.0, 1.0], rel=0.15), line
    profile = load_profile(str(prof))
    alone = {mode: profile.mode(mode).points[0] for mode in POOLS}
    assert alone["eagle"].decode_tok_s / alone["baseline"].decode_tok_s == pytest.approx(2.0, rel=0.15)
    for mode, point in alone.items():
        together = profile.mode(mode).together
        assert point.samples == 9 and together is not None
        assert together.points[0].decode_tok_s == pytest.approx(point.decode_tok_s, rel=0.15)


async def test_bench_rounds_needs_together_and_a_positive_count(emulator: Any) -> None:
    base = await emulator(profile=flat_profile(), time_scale=0.5)
    code, _, stderr = await run_specroute("bench", base.url, "--rounds", "2", "--mode", "baseline")
    assert code == 2 and "--rounds needs --together" in stderr
    code, _, stderr = await run_specroute(
        "bench", base.url, "--together", base.url, "--rounds", "0", "--mode", "baseline"
    )
    assert code == 2 and "--rounds must be at least 1, got 0" in stderr
