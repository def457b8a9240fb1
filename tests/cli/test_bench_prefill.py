"""`specroute bench --prefill` against the emulator: the prefill rate it measures comes back near
the one the emulator was configured with, the cache effect shows, and the profile gets both."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from helpers import cache_profile, run_specroute

from controller.bench.prefill import fit_prefill, fresh_text
from policies.profile import load_profile


def test_fit_recovers_a_known_line_and_refuses_a_flat_one() -> None:
    rng = random.Random(1)
    points = [(n, 0.05 + n / 8000 + rng.uniform(-0.002, 0.002)) for n in (500, 2000, 8000) for _ in range(4)]
    rate, low, high, intercept = fit_prefill(points)
    assert rate is not None and low is not None and high is not None and intercept is not None
    assert low < rate < high and abs(rate - 8000) < 200 and abs(intercept - 0.05) < 0.005
    flat = [(n, 0.05 + rng.uniform(-0.01, 0.01)) for n in (500, 2000, 8000) for _ in range(4)]
    assert fit_prefill(flat)[0] is None
    assert fit_prefill(points[:2])[0] is None  # too few points


def test_fresh_prompts_share_no_prefix() -> None:
    rng = random.Random(0)
    a, b = fresh_text(1000, rng), fresh_text(1000, rng)
    assert a[:20] != b[:20] and 3900 < len(a) < 4100


async def test_bench_measures_the_emulators_prefill_rate_and_cache(emulator: Any, tmp_path: Path) -> None:
    # profile: 20,000 prompt tokens/s; at time_scale 0.25 that is 80,000 per wall second
    scale, rate = 0.25, 20_000.0
    server = await emulator(
        profile=cache_profile(prefill_tok_s=rate),
        time_scale=scale,
        enable_cache_report=True,
        cache_tokens=300_000,
    )
    out, profile_out = tmp_path / "run.json", tmp_path / "profile.json"
    code, stdout, stderr = await run_specroute(
        "bench", server.url, "--prefill", "--prefill-lengths", "1000", "6000", "16000",
        "--prefill-repeats", "4",
        "--concurrency", "1", "--requests-per-level", "3", "--warmup-requests", "0", "--max-tokens", "8",
        "--mode", "baseline", "--out", str(out), "--profile-out", str(profile_out), "--no-progress",
    )  # fmt: skip
    assert code == 0, stderr
    assert "prefill" in stdout and "cold" in stdout
    prefill = json.loads(out.read_text())["metadata"]["prefill"]
    measured = prefill["prefill_tok_s"]
    expected = rate / scale
    assert 0.75 * expected < measured < 1.3 * expected, (measured, expected)
    assert len(prefill["points"]) == 12 and prefill["errors"] == 0
    # the same 16k-token prompt twice: the second reports nearly all of it cached and skips its prefill
    assert prefill["cached_fraction"]["mean"] > 0.95
    assert prefill["warm_ttft_s"]["mean"] < prefill["cold_ttft_s"]["mean"] / 2
    mode = load_profile(profile_out).mode("baseline")
    assert mode.prefill_tok_s is not None and math.isclose(mode.prefill_tok_s, measured, rel_tol=1e-3)
    assert mode.cache_tokens == 300_000
    assert "prefill_tok_s fitted" in load_profile(profile_out).source


async def test_bench_without_prefill_writes_no_prefill_fields(emulator: Any, tmp_path: Path) -> None:
    server = await emulator(time_scale=0.05)
    profile_out = tmp_path / "profile.json"
    code, _, stderr = await run_specroute(
        "bench", server.url, "--concurrency", "1", "--requests-per-level", "2", "--warmup-requests", "0",
        "--max-tokens", "4", "--mode", "baseline", "--profile-out", str(profile_out), "--no-progress",
    )  # fmt: skip
    assert code == 0, stderr
    mode = load_profile(profile_out).mode("baseline")
    assert mode.prefill_tok_s is None and mode.cache_tokens is None
