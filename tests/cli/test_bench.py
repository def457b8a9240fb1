"""`specroute bench` against a fake SGLang-shaped server with known pacing.

The fake streams chat/completions chunks on an absolute schedule: first token (the role
chunk) `ttft_s` after the request arrives, then one token every `interval_s`, grouped
`tokens_per_chunk` to a chunk as EAGLE does, so a request's decode rate is exactly
1 / interval_s and the measurement can be checked against it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from fakes import QUEUE_FULL, SSE_DONE, sglang_error, sse, sse_error, stream_chunk, stream_event
from helpers import run_specroute

from controller.bench.prompts import load_prompts
from controller.bench.runner import run_sweep
from policies.profile import load_profile, parse_profile, resolve_profile

pytestmark = pytest.mark.timeout(120)


@dataclass
class Pacing:
    ttft_s: float = 0.02
    interval_s: float = 0.005
    tokens_per_chunk: int = 1
    fail_every: int = 0
    """Every k-th request (1-based) fails; the failure kinds rotate (HTTP 500, error event,
    stream without usage, a plain JSON answer instead of a stream)."""
    interval_factors: tuple[float, ...] = (1.0,)
    slow_from: int | None = None
    """Requests from this index on take 1 s per token (to interrupt a level mid-way)."""
    """Request i uses interval_s * interval_factors[i % len]: a known spread."""
    info_path: str = "/server_info"
    """Where the fake answers server info (older SGLang: /get_server_info)."""
    server_info: dict[str, Any] | None = field(
        default_factory=lambda: {
            "max_running_requests": 48,
            "speculative_algorithm": "EAGLE3",
            "speculative_num_steps": 3,
            "internal_states": [{"avg_spec_accept_length": 2.5, "last_gen_throughput": 100.0}],
        }
    )


class FakeSGLang:
    def __init__(self, pacing: Pacing) -> None:
        self.pacing = pacing
        self.count = 0
        self.failures = 0
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.slow_started = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get(self.pacing.info_path, self.info)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def info(self, request: web.Request) -> web.Response:
        if self.pacing.server_info is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response(self.pacing.server_info)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrived = asyncio.get_running_loop().time()
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        idx = self.count
        self.count += 1
        p = self.pacing
        chat = request.path.endswith("chat/completions")
        rid = uuid.uuid4().hex
        failure = None
        if p.fail_every and (idx + 1) % p.fail_every == 0:
            failure = ("http", "event", "no_usage", "json")[self.failures % 4]
            self.failures += 1
        if failure == "json":
            return web.json_response({"id": rid, "object": "chat.completion", "choices": []})
        if failure == "http":
            return web.json_response(sglang_error("boom", 500, "InternalServerError"), status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        model = body.get("model")

        async def send(chunk: dict[str, Any]) -> None:
            await resp.write(sse(chunk))

        def chunk(text: str | None, role: bool = False, finish: str | None = None) -> dict[str, Any]:
            return stream_chunk(rid, model, chat, text, finish, role)

        if failure == "event":
            await resp.write(sse_error(QUEUE_FULL) + SSE_DONE)
            return resp
        n = int(body.get("max_tokens", 16))
        dt = p.interval_s * p.interval_factors[idx % len(p.interval_factors)]
        if p.slow_from is not None and idx >= p.slow_from:
            dt = 1.0
            self.slow_started.set()
        loop = asyncio.get_running_loop()

        async def until(t: float) -> None:
            await asyncio.sleep(max(0.0, t - loop.time()))

        first = arrived + p.ttft_s
        await until(first)
        if chat:
            await send(chunk(None, role=True))
        await send(chunk("tok "))
        sent = 1
        while sent < n:
            k = min(p.tokens_per_chunk, n - sent)
            await until(first + (sent + k - 1) * dt)
            await send(chunk("tok " * k))
            sent += k
        await send(chunk(None, finish="length"))
        if failure != "no_usage" and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": n + 12}
            await send(stream_event(rid, model, chat, [], usage=usage))
        await resp.write(SSE_DONE)
        return resp


@dataclass
class Running:
    url: str
    fake: FakeSGLang


async def start_fake(pacing: Pacing) -> AsyncIterator[Running]:
    fake = FakeSGLang(pacing)
    runner = web.AppRunner(fake.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield Running(f"http://127.0.0.1:{port}", fake)
    finally:
        await runner.cleanup()


@pytest.fixture
async def server(request: pytest.FixtureRequest) -> AsyncIterator[Running]:
    pacing = getattr(request, "param", None) or Pacing()
    async for s in start_fake(pacing):
        yield s


@pytest.mark.parametrize(
    "server",
    [Pacing(interval_s=0.01, tokens_per_chunk=1), Pacing(interval_s=0.01, tokens_per_chunk=4)],
    indirect=True,
    ids=["1-token-chunks", "4-token-chunks"],
)
async def test_decode_rate_at_concurrency_1_matches_pacing(server: Running) -> None:
    result = await run_sweep(server.url, levels=[1], requests_per_level=6, warmup=1, max_tokens=21)
    s = result.levels[0].summary
    assert (s.n, s.errors) == (6, 0)
    assert s.decode_tok_s is not None and s.ttft_s is not None and s.total_tok_s is not None
    # pacing: 100 tok/s after the first token, first token 20 ms after arrival
    assert 70.0 < s.decode_tok_s.mean < 110.0
    assert s.ttft_s.mean > 0.015
    # one request in flight: total = 21 tokens per (20 ms + 200 ms) = ~95 tok/s
    assert 40.0 < s.total_tok_s.mean < 110.0
    assert s.decode_tok_s.p50 is not None and s.decode_tok_s.p99 is not None
    measured = [r for r in result.levels[0].requests if r.phase == "measured"]
    assert all(r.completion_tokens == 21 for r in measured)
    assert server.fake.count == 7  # 1 warm-up + 6 measured, nothing else at concurrency 1
    body = server.fake.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "fake-model" and body["messages"][0]["role"] == "user"
    assert result.metadata["server_info"]["avg_spec_accept_length"] == 2.5
    assert result.metadata["server_info"]["max_running_requests"] == 48
    # the depth it drafts at (`--speculative-num-steps`), which the adaptive-server model scales from
    assert result.to_profile("eagle").mode("eagle").speculative_num_steps == 3
    assert result.to_profile("baseline").mode("baseline").speculative_num_steps is None


@pytest.mark.parametrize(
    "server", [Pacing(interval_s=0.004, interval_factors=(0.7, 1.3, 0.85, 1.15))], indirect=True
)
async def test_interval_shrinks_as_requests_per_level_grow(server: Running) -> None:
    small = await run_sweep(server.url, levels=[2], requests_per_level=4, warmup=1, max_tokens=11)
    large = await run_sweep(server.url, levels=[2], requests_per_level=24, warmup=1, max_tokens=11)
    a, b = small.levels[0].summary.decode_tok_s, large.levels[0].summary.decode_tok_s
    assert a is not None and b is not None and a.half_width and b.half_width
    assert (a.n, b.n) == (4, 24)
    assert b.half_width < a.half_width / 1.5


@pytest.mark.parametrize("server", [Pacing(interval_s=0.01, fail_every=3)], indirect=True)
async def test_failed_requests_are_counted_as_errors(server: Running) -> None:
    result = await run_sweep(server.url, levels=[1], requests_per_level=12, warmup=0, max_tokens=11)
    lv = result.levels[0]
    s = lv.summary
    errors = [r.error or "" for r in lv.requests if not r.ok]
    assert s.n == 12 and s.errors == 4 and s.ok == 8  # requests 3, 6, 9, 12 fail
    assert any(e.startswith("HTTP 500") for e in errors)
    assert any("error event" in e and "queue is full" in e for e in errors)
    assert any("no usage" in e for e in errors)
    assert any("no SSE events" in e for e in errors)
    # failed requests are instant: averaging them in would inflate speed and shrink TTFT
    assert s.decode_tok_s is not None and s.decode_tok_s.n == 8
    # pacing 100 tok/s; 2x leaves room for a loaded machine delaying the first chunk
    assert s.decode_tok_s.mean < 200.0
    assert s.ttft_s is not None and s.ttft_s.n == 8 and s.ttft_s.mean > 0.015


@pytest.mark.parametrize("server", [Pacing(interval_s=0.002)], indirect=True)
async def test_completions_endpoint_and_user_prompts(server: Running, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def fib(n):"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    result = await run_sweep(
        server.url,
        levels=[2],
        requests_per_level=4,
        warmup=0,
        max_tokens=6,
        prompts=str(prompts),
        endpoint="completions",
    )
    s = result.levels[0].summary
    assert (s.n, s.errors) == (4, 0)
    assert {b["prompt"] for b in server.fake.bodies} == {"def fib(n):", "hi"}
    assert result.metadata["prompt_set"] == str(prompts)


@pytest.mark.parametrize("server", [Pacing(server_info=None)], indirect=True)
async def test_missing_server_info_is_recorded_as_null(server: Running) -> None:
    result = await run_sweep(server.url, levels=[1], requests_per_level=2, warmup=0, max_tokens=4)
    info = result.metadata["server_info"]
    assert info["avg_spec_accept_length"] is None and info["max_running_requests"] is None
    profile = result.to_profile("eagle")
    assert profile.mode("eagle").accept_length is None


@pytest.mark.parametrize("server", [Pacing(info_path="/get_server_info")], indirect=True)
async def test_older_get_server_info_is_read_when_server_info_is_missing(server: Running) -> None:
    result = await run_sweep(server.url, levels=[1], requests_per_level=2, warmup=0, max_tokens=4)
    info = result.metadata["server_info"]
    assert info["endpoint"] == "/get_server_info"
    assert info["avg_spec_accept_length"] == 2.5 and info["max_running_requests"] == 48


def test_builtin_prompt_sets_are_large_enough() -> None:
    for name in ("coding", "general"):
        ps = load_prompts(name)
        texts = {json.dumps(p.body("chat")) for p in ps.prompts}
        assert len(texts) >= 250, name


@pytest.mark.parametrize("server", [Pacing(interval_s=0.002)], indirect=True)
async def test_cli_writes_results_and_a_profile_that_round_trips(server: Running, tmp_path: Path) -> None:
    out, prof = tmp_path / "r.json", tmp_path / "eagle.json"
    code, stdout, stderr = await run_specroute(
        "bench",
        server.url,
        "--concurrency",
        "1",
        "3",
        "--requests-per-level",
        "5",
        "--warmup-requests",
        "1",
        "--max-tokens",
        "8",
        "--label",
        "fake eagle",
        "--out",
        str(out),
        "--profile-out",
        str(prof),
        "--mode",
        "eagle",
        "--no-progress",
        "--header",
        "x-specroute-mode:eagle",
        "--api-key",
        "sk-test",
        timeout_s=90,
    )
    assert code == 0, stderr
    assert all(h.get("x-specroute-mode") == "eagle" for h in server.fake.headers)
    assert all(h.get("Authorization") == "Bearer sk-test" for h in server.fake.headers)
    assert "concurrency    1: n=5 errors=0" in stdout and "concurrency    3: n=5 errors=0" in stdout
    data = json.loads(out.read_text())
    assert data["format"] == "specroute.bench/v1"
    md = data["metadata"]
    assert md["label"] == "fake eagle" and md["prompt_set"] == "coding" and md["url"] == server.url
    assert md["specroute_version"] and md["started"] and md["interrupted"] is False
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 3]
    assert sum(r["phase"] == "measured" for r in data["levels"][1]["requests"]) == 5
    profile = load_profile(prof)
    mode = profile.mode("eagle")
    assert [p.concurrency for p in mode.points] == [1, 3]
    assert all(p.samples == 5 and p.decode_tok_s > 0 and p.ttft_s > 0 for p in mode.points)
    assert mode.accept_length == 2.5 and mode.max_running_requests == 48
    assert parse_profile(json.loads(profile.to_json())) == profile
    # The profile stores the level's median (robust to a burst-inflated request), not its mean.
    assert mode.points[0].decode_tok_s == pytest.approx(
        data["levels"][0]["summary"]["decode_tok_s"]["p50"], rel=1e-3
    )


@pytest.mark.parametrize("server", [Pacing(interval_s=0.012)], indirect=True)
async def test_quick_sweep_shows_where_it_is_in_a_log(server: Running, tmp_path: Path) -> None:
    """`--quick` runs its short sweep (levels 1 4 16, 10 requests after 1 warm-up, 64 tokens);
    stderr is a pipe, so progress comes as plain lines (no tqdm bar: no carriage returns) with
    the requests in flight and the ETAs; after each level but the last, the sweep's ETA."""
    out = tmp_path / "q.json"
    code, stdout, stderr = await run_specroute(
        "bench", server.url, "--quick", "--out", str(out), timeout_s=110
    )
    assert code == 0, stderr
    md = json.loads(out.read_text())["metadata"]
    assert (md["levels"], md["requests_per_level"], md["warmup"], md["max_tokens"]) == ([1, 4, 16], 10, 1, 64)
    assert "\r" not in stderr and "it/s" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("bench level ")]
    assert lines and all("in flight" in ln and "ETA level " in ln and ", sweep " in ln for ln in lines)
    assert {ln.split()[2] for ln in lines} == {"1/3", "2/3", "3/3"}  # every level says it started
    assert any(" sweep ?" not in ln for ln in lines)  # an estimate once a request has finished
    assert stdout.count("to go (estimate)") == 2
    # a flag given explicitly wins over --quick's
    code, stdout, stderr = await run_specroute(
        "bench", server.url, "--quick", "--concurrency", "2", "--max-tokens", "4", "--no-progress",
        timeout_s=60,
    )  # fmt: skip
    assert code == 0, stderr
    assert "levels 2, 10 requests per level after 1 warm-up, max_tokens 4" in stdout
    assert "bench level" not in stderr


@pytest.mark.parametrize("server", [Pacing(interval_s=0.002, slow_from=3)], indirect=True)
async def test_ctrl_c_keeps_finished_levels(server: Running, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "controller.cli",
        "bench",
        server.url,
        "--concurrency",
        "1",
        "2",
        "--requests-per-level",
        "3",
        "--warmup-requests",
        "0",
        "--max-tokens",
        "4",
        "--no-progress",
        "--out",
        str(out),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        # Ctrl-C as a terminal delivers it, whatever this process inherited: a shell without job
        # control starts background commands with SIGINT ignored, and a child inherits that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    # the second level is slow (requests 3 and later): interrupt it once the first is out
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode()
        if line.startswith("concurrency    1:") or not line:
            break
    assert line.startswith("concurrency    1:"), "first level never finished"
    await asyncio.wait_for(server.fake.slow_started.wait(), timeout=30)  # level 2 under way
    proc.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 130, err.decode()
    assert "Traceback" not in err.decode()
    data = json.loads(out.read_text())
    assert data["metadata"]["interrupted"] is True
    assert [lv["concurrency"] for lv in data["levels"]] == [1]


async def test_bad_input_gives_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "wrong key"}\n')
    cases = [
        (["bench", "http://127.0.0.1:9", "--prompts", str(bad)], "bad.jsonl:2"),
        (["bench", "http://127.0.0.1:9", "--prompts", "nosuchset"], "no built-in prompt set"),
        (["bench", "http://127.0.0.1:9", "--profile-out", "x.json"], "--mode"),
        (["bench"], "URL is required"),
        (["bench", "127.0.0.1:9"], "http://"),
        (["bench", "http://127.0.0.1:9", "--concurrency", "1", "--no-progress"], "cannot reach"),
        (["bench", "--concurrency", "0"], "must be >= 1"),
        (["bench", "http://127.0.0.1:9", "--timeout", "0"], "timeout must be a positive number"),
    ]
    for argv, needle in cases:
        code, _, err = await run_specroute(*argv, timeout_s=90)
        assert code == 2, (argv, err)
        assert needle in err and "Traceback" not in err, (argv, err)


def test_module_imports_without_side_effects() -> None:
    code = "import controller.bench.runner, controller.cli.bench; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "ok\n" and proc.stderr == ""


async def test_against_the_emulator_when_present() -> None:
    emulator = pytest.importorskip("simulator.emulator.app")
    profile = resolve_profile("kimi-k25-int4-8gpu")
    scale = 0.2  # wall seconds per profile second
    config = emulator.EmulatorConfig(mode="eagle", profile=profile, time_scale=scale)
    async with emulator.run_emulator(config) as srv:
        result = await run_sweep(srv.url, levels=[1, 4], requests_per_level=6, warmup=1, max_tokens=30)
    speed = profile.speed("eagle")
    for lv in result.levels:
        s = lv.summary
        assert s.errors == 0 and s.decode_tok_s is not None
        expected = speed.decode_tok_s(lv.concurrency) / scale
        assert 0.6 * expected < s.decode_tok_s.mean < 1.3 * expected, (lv.concurrency, expected)
    info = result.metadata["server_info"]
    assert info["max_running_requests"] == 48
    assert info["avg_spec_accept_length"] == pytest.approx(2.4, abs=0.6)


@pytest.mark.parametrize("server", [Pacing(interval_s=0.003)], indirect=True)
async def test_measured_requests_run_at_the_level_concurrency(server: Running) -> None:
    result = await run_sweep(server.url, levels=[4], requests_per_level=6, warmup=2, max_tokens=12)
    reqs = result.levels[0].requests
    phases = [r.phase for r in reqs]
    assert phases.count("measured") == 6 and phases.count("warmup") >= 4 and "filler" in phases
    for r in reqs:
        if r.phase != "measured":
            continue
        assert r.end_s is not None
        mid = (r.start_s + r.end_s) / 2
        active = sum(1 for o in reqs if o.end_s is not None and o.start_s <= mid <= o.end_s)
        assert active >= 3  # the level's 4, but a worker may be between two requests
    assert server.fake.count == len(reqs)
