"""`specroute plan`: deployment enumeration, statistics, hand-checkable rankings, the kimi
figures, determinism across --jobs, and the written config checked and served for real."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from controller.cli import main as specroute
from policies.profile import Profile, parse_profile, resolve_profile
from policies.registry import default_registry
from policies.stats import interval, paired_margin, t95
from simulator.engine.results import Slo
from simulator.engine.workloads import AcceptModel, LengthSpec, WorkloadSpec
from simulator.planning.plan import (
    PlanError,
    PlanResult,
    PlanSpec,
    candidates,
    count_simulations,
    enumerate_deployments,
    plan,
    scale_workload,
)
from simulator.planning.report import plan_json

KIMI = "kimi-k25-int4-8gpu"


def two_mode_profile(base_tok_s: tuple[float, float], eagle_tok_s: tuple[float, float]) -> Profile:
    """Per-request decode rate at concurrency 1 and 64 for each mode; no caps, equal TTFT."""

    def mode(rates: tuple[float, float]) -> dict[str, Any]:
        return {
            "points": [
                {"concurrency": 1, "decode_tok_s": rates[0], "ttft_s": 0.1},
                {"concurrency": 64, "decode_tok_s": rates[1], "ttft_s": 0.1},
            ]
        }

    return parse_profile(
        {
            "format": "specroute.profile/v1",
            "name": "hand-checkable",
            "modes": {"baseline": mode(base_tok_s), "eagle": mode(eagle_tok_s)},
        }
    )


def small_sweep(*levels: int, n: int = 20) -> WorkloadSpec:
    return WorkloadSpec(levels=levels, requests_per_level=n, warmup=2, output_tokens=LengthSpec("exp", 100))


def run_plan(profile: Profile, spec: PlanSpec, jobs: int = 1) -> PlanResult:
    return plan(profile, spec, registry=default_registry(entry_points=False), jobs=jobs)


def by_label(result: PlanResult, factor: float = 1.0) -> dict[str, Any]:
    lr = next(r for r in result.loads if r.factor == factor)
    return {r.entry.label: r.entry for r in lr.ranking}


# --- enumeration, grids, load scaling ---------------------------------------------------------


def test_deployments_of_four_servers_over_all_kinds() -> None:
    deps = enumerate_deployments(4, ("baseline", "eagle", "adaptive"))
    assert deps == [
        (("baseline", 4),),
        (("baseline", 3), ("eagle", 1)),
        (("baseline", 2), ("eagle", 2)),
        (("baseline", 1), ("eagle", 3)),
        (("eagle", 4),),
        (("adaptive", 4),),
    ]
    assert enumerate_deployments(3, ("baseline",)) == [(("baseline", 3),)]
    assert enumerate_deployments(2, ("eagle", "adaptive")) == [(("eagle", 2),), (("adaptive", 2),)]
    with pytest.raises(PlanError, match="servers"):
        enumerate_deployments(0, ("baseline",))


def test_default_grids_are_valid_and_scale_thresholds_with_the_eagle_pool() -> None:
    spec = PlanSpec(servers=4, kinds=("baseline", "eagle"), workload=small_sweep(1), objective="mean_e2e_s")
    registry = default_registry(entry_points=False)
    one = candidates(spec, (("baseline", 3), ("eagle", 1)), registry)
    three = candidates(spec, (("baseline", 1), ("eagle", 3)), registry)
    thresholds = sorted({c.params["threshold"] for c in one if c.name == "threshold"})
    assert thresholds == [2, 4, 8, 16, 32]
    assert sorted({c.params["threshold"] for c in three if c.name == "threshold"}) == [6, 12, 24, 48, 96]
    assert [c.params for c in one if c.name == "cost_model"] == [{"objective": "e2e"}, {"objective": "ttft"}]
    assert [c.params for c in one if c.name == "online"] == [{"epsilon": 0.02}, {"epsilon": 0.05}]
    assert [c.name for c in candidates(spec, (("eagle", 4),), registry)] == ["least_loaded"]
    # 3 mixed deployments x 14 points + 5 deployments, x 3 loads x 3 seeds
    assert count_simulations(spec, registry) == 3 * 3 * (3 * 14 + 5)


def test_user_grids_leave_out_combinations_the_policy_rejects() -> None:
    grid = [("threshold", ["1", "4"]), ("hysteresis", ["0", "1", "2"])]
    spec = PlanSpec(
        servers=2, kinds=("baseline", "eagle"), workload=small_sweep(1), objective="mean_e2e_s",
        policies=("threshold",), grids={"threshold": grid},
    )  # fmt: skip
    registry = default_registry(entry_points=False)
    points = [c.params for c in candidates(spec, (("baseline", 1), ("eagle", 1)), registry)]
    # hysteresis must be smaller than threshold: (1, 1) and (1, 2) are not points
    assert points == [{"threshold": 1, "hysteresis": 0}] + [
        {"threshold": 4, "hysteresis": h} for h in (0, 1, 2)
    ]
    bad = dataclasses.replace(spec, grids={"threshold": [("threshold", ["0", "4"])]})
    with pytest.raises(PlanError, match="threshold=0 is valid in no combination"):
        candidates(bad, (("baseline", 1), ("eagle", 1)), registry)


def test_load_factors_scale_concurrency_rate_and_trace_speed() -> None:
    sweep = WorkloadSpec(levels=(1, 2, 10, 250))
    assert scale_workload(sweep, 0.5).levels == (1, 1, 5, 125)
    assert scale_workload(sweep, 1.5).levels == (2, 3, 15, 375)
    assert scale_workload(WorkloadSpec(kind="poisson", rate=4.0), 1.5).rate == 6.0
    trace = WorkloadSpec(kind="trace", trace="x.csv", time_scale=2.0)
    assert scale_workload(trace, 0.5).time_scale == 4.0  # half the load: replayed half as fast


# --- statistics -------------------------------------------------------------------------------


def test_t_intervals_and_paired_margins() -> None:
    # exact quantiles (a 3-digit table gave 2.021 at 31 degrees of freedom: intervals too narrow)
    assert t95(1) == pytest.approx(12.7062, abs=1e-4) and t95(2) == pytest.approx(4.3027, abs=1e-4)
    assert t95(31) == pytest.approx(2.0395, abs=1e-4) and t95(1000) == pytest.approx(1.9623, abs=1e-4)
    iv = interval([1.0, 2.0, 3.0])
    assert iv.mean == 2.0 and iv.half == pytest.approx(4.302653 / math.sqrt(3))
    # Paired: a constant 0.5 advantage is a win although both series vary a lot.
    a, b = [1.0, 5.0, 9.0], [1.5, 5.5, 9.5]
    m = paired_margin(a, b, higher_is_better=False)
    assert m.verdict == "win" and m.diff.mean == pytest.approx(0.5) and m.diff.half == pytest.approx(0.0)
    # Differences that change sign are inside the noise.
    assert paired_margin([1.0, 2.0, 3.0], [1.1, 1.9, 3.05], higher_is_better=False).verdict == "tie"
    assert paired_margin([2.0, 2.0], [2.0, 2.0], higher_is_better=False).verdict == "tie"
    # Higher is better (goodput): sign flips.
    assert paired_margin([10.0, 11.0], [8.0, 9.0], higher_is_better=True).diff.mean == pytest.approx(2.0)
    # A consistent but tiny margin is a tie under the tolerance, a win without it.
    assert paired_margin([100.0, 100.0], [100.5, 100.5], higher_is_better=False).verdict == "win"
    tol = paired_margin([100.0, 100.0], [100.5, 100.5], higher_is_better=False, tie_within=0.01)
    assert tol.verdict == "tie"
    assert paired_margin([1.0], [2.0], higher_is_better=False).verdict == "n/a"  # one seed


# --- rankings that can be checked by hand ---------------------------------------------------


@pytest.mark.parametrize(
    ("eagle_tok_s", "expected"),
    [((160.0, 40.0), "eagle=2"), ((40.0, 10.0), "baseline=2")],
    ids=["eagle-faster-everywhere", "eagle-slower-everywhere"],
)
def test_hand_checkable_profiles(eagle_tok_s: tuple[float, float], expected: str) -> None:
    profile = two_mode_profile((80.0, 20.0), eagle_tok_s)
    # up to 75 clients per server: the adaptive servers' default ladder drafts 3 steps (as deep as
    # the profile was measured: the EAGLE-3 speed) below batch 32, 1 step below 64, none beyond
    spec = PlanSpec(
        servers=2,
        kinds=("baseline", "eagle", "adaptive"),
        workload=small_sweep(1, 10, 100),
        objective="mean_e2e_s",
        policies=("cost_model", "threshold"),
        seeds=(0, 1, 2),
        loads=(1.0, 1.5),
    )
    result = run_plan(profile, spec)
    for lr in result.loads:
        assert lr.best.label == expected
        assert lr.ranking[0].margin is not None and lr.ranking[0].margin.verdict == "win"
        assert lr.tied_with_best == []
    assert [lr.factor for lr in result.loads] == [1.0, 1.5]


def test_kimi_mixed_beats_all_plain_at_concurrency_1_and_loses_at_250() -> None:
    profile = resolve_profile(KIMI)
    figures = {}
    # At 250 clients the warm-up and the measured window span the whole level (a steady state);
    # with only 30 measured requests the window would be the first few seconds, which a policy
    # keeping the eagle server nearly empty could pass through quickly.
    for conc, warmup, measured in ((1, 5, 30), (250, 250, 500)):
        spec = PlanSpec(
            servers=2,
            kinds=("baseline", "eagle"),
            workload=WorkloadSpec(levels=(conc,), requests_per_level=measured, warmup=warmup),
            objective="mean_e2e_s",
            seeds=(0, 1),
            loads=(1.0,),
        )
        entries = by_label(run_plan(profile, spec))
        mixed, plain = entries["baseline=1,eagle=1"], entries["baseline=2"]
        figures[conc] = (mixed.score.mean, plain.score.mean)
        better, worse = (mixed, plain) if conc == 1 else (plain, mixed)
        margin = paired_margin(better.scores, worse.scores, higher_is_better=False, tie_within=0.01)
        assert margin.verdict == "win", (conc, figures)
    # concurrency 1: EAGLE-3 decodes 96.1 vs 92.7 tok/s -> 200 tokens in ~2.32 s vs ~2.38 s, each
    # after prefilling the 256-token prompt at the profile's 7600 / 8000 tok/s
    assert figures[1][0] == pytest.approx(0.22 + 256 / 7600 + 199 / 96.1, rel=0.01)
    assert figures[1][1] == pytest.approx(0.20 + 256 / 8000 + 199 / 92.7, rel=0.01)
    # concurrency 250: two plain servers (~34 s) beat plain + EAGLE-3, tuned (~42 s)
    mixed_250, plain_250 = figures[250]
    assert plain_250 == pytest.approx(33.8, rel=0.05)
    assert plain_250 < 0.9 * mixed_250


def test_goodput_objective_ranks_highest_first() -> None:
    profile = resolve_profile(KIMI)
    spec = PlanSpec(
        servers=2,
        kinds=("baseline", "eagle"),
        workload=WorkloadSpec(kind="poisson", rate=3.0, requests=150, output_tokens=LengthSpec("exp", 150)),
        objective="goodput",
        policies=("cost_model",),
        slo=Slo(ttft_s=0.5, tpot_s=0.05),
        seeds=(0, 1),
        loads=(1.0,),
    )
    ranking = run_plan(profile, spec).loads[0].ranking
    means = [r.entry.score.mean for r in ranking]
    assert means == sorted(means, reverse=True) and means[0] > 0


def test_same_plan_for_one_and_two_jobs() -> None:
    profile = resolve_profile(KIMI)
    spec = PlanSpec(
        servers=3,
        kinds=("baseline", "eagle", "adaptive"),
        workload=WorkloadSpec(
            kind="poisson",
            rate=2.0,
            requests=120,
            output_tokens=LengthSpec("lognormal", 150, 0.8),
            accept=AcceptModel(sigma=0.3),
        ),
        objective="p99_e2e_s",
        policies=("cost_model", "online"),
        seeds=(3, 4),
        loads=(0.5, 1.0),
    )
    one = plan_json(run_plan(profile, spec, jobs=1), None)
    two = plan_json(run_plan(profile, spec, jobs=2), None)
    assert json.dumps(one, sort_keys=True) == json.dumps(two, sort_keys=True)
    assert one["simulations"] == 2 * (2 * 4 * 2 + 5 * 2)


# --- the command line -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--servers", "0"], "--servers must be >= 1"),
        (["--servers", "2", "--kinds", "baseline,turbo"], "unknown server kind 'turbo'"),
        (["--servers", "2", "--policies", "nope"], "nope"),
        (["--servers", "2", "--objective", "goodput"], "needs --slo-ttft"),
        (["--servers", "2", "--loads", "-1"], "load factors"),
        (["--servers", "2", "--workload", "trace", "--trace", "/nonexistent.csv"], "nonexistent"),
        (["--servers", "2", "--grid", "threshold:threshold=1,x"], "threshold"),
        (["--servers", "2", "--grid", "online:epsilon=0.1"], "not in --policies"),
        (["--servers", "2", "--jobs", "0"], "--jobs"),
    ],
)
def test_bad_input_is_a_clear_error(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = str(tmp_path / "c.yaml")
    rc = specroute(
        [
            "plan",
            "--profile",
            KIMI,
            "--concurrency",
            "1",
            "--policies",
            "threshold",
            "--no-progress",
            "--out",
            out,
            *args,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("specroute plan: error:") and message in err
    assert "Traceback" not in err
    assert not (tmp_path / "c.yaml").exists()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controller.cli", *args], capture_output=True, text=True, timeout=120
    )


async def test_plan_writes_a_config_that_checks_and_serves(tmp_path: Path, spawn_serve: Any) -> None:
    cfg, report = tmp_path / "plan.yaml", tmp_path / "report"
    proc = await asyncio.to_thread(
        _cli,
        "plan",
        "--profile",
        KIMI,
        "--servers",
        "3",
        "--kinds",
        "baseline,eagle",
        "--concurrency",
        "1",
        "5",
        "--requests-per-level",
        "15",
        "--policies",
        "cost_model,threshold",
        "--grid",
        "threshold:threshold=4,16",
        "--seeds",
        "0",
        "1",
        "--jobs",
        "2",
        "--out",
        str(cfg),
        "--report",
        str(report),
        "--json",
        "--model-path",
        "moonshotai/Kimi-K2.5",
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [lr["factor"] for lr in doc["loads"]] == [0.5, 1.0, 1.5]
    ref = doc["loads"][1]
    assert (
        doc["winner"]
        == ref["best"]
        == ",".join(f"{k}={v}" for k, v in ref["ranking"][0]["deployment"].items())
    )
    assert len(ref["ranking"]) == 4 and ref["ranking"][-1]["margin_to_next"] is None
    for row in ref["ranking"]:
        assert row["objective"]["n"] == 2 and len(row["objective"]["per_seed"]) == 2
        assert row["margin_to_next"] is None or row["margin_to_next"]["verdict"] in ("win", "tie")
        assert math.isclose(sum(row["summary"]["pool_share"].values()), 1.0)
    assert "simulations" not in proc.stderr  # stderr is a pipe: no progress bar in a log

    text = cfg.read_text()
    assert "python -m sglang.launch_server --model-path moonshotai/Kimi-K2.5" in text
    settings = yaml.safe_load(text)
    winner = ref["ranking"][0]["deployment"]
    assert len(settings["baseline"]) == winner.get("baseline", 0)
    assert len(settings["eagle"]) == winner.get("eagle", 0)
    if winner.get("eagle"):
        assert "--speculative-algorithm EAGLE3" in text and "--speculative-eagle-topk 1" in text
    assert settings["profile"] == KIMI
    assert (report / "report.md").read_text().count("## Load") == 3
    assert (report / "objective_vs_load.png").read_bytes()[:4] == b"\x89PNG"

    # the placeholder URLs are refused until they are replaced; the rest is a valid serve config
    check = await asyncio.to_thread(_cli, "check-config", str(cfg))
    assert check.returncode == 2 and "is a placeholder" in check.stderr and ".invalid" in check.stderr
    assert "replace it with your server's URL" in check.stderr
    assert "hosts under .invalid: `specroute serve` refuses them" in text
    filled = tmp_path / "filled.yaml"
    filled.write_text(_fill_placeholders(text))
    check = await asyncio.to_thread(_cli, "check-config", str(filled))
    assert check.returncode == 0, check.stderr
    assert "valid" in check.stdout

    served = await spawn_serve("--config", str(filled), "--host", "127.0.0.1")
    async with aiohttp.ClientSession() as session, session.get(served.url + "/health") as resp:
        assert resp.status == 200
    served.signal(signal.SIGTERM)
    assert await served.wait() == 0


def _fill_placeholders(text: str) -> str:
    """A plan's config with its placeholder hosts (`kind-i.invalid`) replaced by loopback ports."""
    ports = iter(range(41000, 41100))
    return re.sub(r"http://[a-z]+-\d+\.invalid:\d+", lambda _: f"http://127.0.0.1:{next(ports)}", text)


def test_single_pool_winner_gets_the_fixed_policy(tmp_path: Path) -> None:
    profile = tmp_path / "slow-eagle.json"
    p = {
        "format": "specroute.profile/v1",
        "name": "slow eagle",
        "modes": {
            "baseline": {"points": [{"concurrency": 1, "decode_tok_s": 80.0, "ttft_s": 0.1},
                                    {"concurrency": 64, "decode_tok_s": 20.0, "ttft_s": 0.1}]},
            "eagle": {"max_running_requests": 32,
                      "points": [{"concurrency": 1, "decode_tok_s": 40.0, "ttft_s": 0.1},
                                 {"concurrency": 64, "decode_tok_s": 10.0, "ttft_s": 0.1}]},
        },
    }  # fmt: skip
    profile.write_text(json.dumps(p))
    cfg = tmp_path / "c.yaml"
    rc = specroute(
        ["plan", "--profile", str(profile), "--servers", "2", "--concurrency", "1", "8", "--seeds", "0", "1",
         "--policies", "cost_model", "--loads", "1", "--no-progress", "--out", str(cfg)]
    )  # fmt: skip
    assert rc == 0
    settings = yaml.safe_load(cfg.read_text())
    assert settings["policy"] == "fixed" and settings["policy_params"] == {"pool": "baseline"}
    assert len(settings["baseline"]) == 2 and settings["eagle"] == []
    assert settings["profile"] == str(profile.resolve())
    check = _cli("check-config", str(cfg))
    assert check.returncode == 2 and "'http://baseline-1.invalid:30000' is a placeholder" in check.stderr
    cfg.write_text(_fill_placeholders(cfg.read_text()))
    check = _cli("check-config", str(cfg))
    assert check.returncode == 0, check.stderr


def test_profile_without_an_eagle_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "plain-only.json"
    mode = {"points": [{"concurrency": 1, "decode_tok_s": 80.0, "ttft_s": 0.1}]}
    profile.write_text(
        json.dumps({"format": "specroute.profile/v1", "name": "plain", "modes": {"baseline": mode}})
    )
    argv = ["plan", "--profile", str(profile), "--servers", "2", "--concurrency", "1", "--no-progress"]
    assert specroute([*argv, "--out", str(tmp_path / "a.yaml")]) == 2
    err = capsys.readouterr().err
    assert "no 'eagle' mode" in err and "--kinds" in err and "Traceback" not in err
    assert specroute([*argv, "--kinds", "baseline", "--out", str(tmp_path / "b.yaml"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["winner"] == "baseline=2" and doc["loads"][1]["ranking"][0]["margin_to_next"] is None


def test_bad_settings_fail_before_the_progress_bar(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    base = [
        "plan",
        "--profile",
        KIMI,
        "--servers",
        "2",
        "--concurrency",
        "1",
        "--out",
        str(tmp_path / "c.yaml"),
    ]
    for extra, message in ((["--loads", "0"], "load factors"), (["--tie-within", "-1"], "tie tolerance")):
        assert specroute([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "simulations" not in err, err


def test_a_vllm_profile_gets_vllm_launch_lines(tmp_path: Path) -> None:
    """A profile `specroute bench` measured on vLLM (its `engine` field) plans vLLM servers."""
    profile = tmp_path / "vllm-pair.json"
    p = {
        "format": "specroute.profile/v1",
        "name": "tiny llama on vLLM CPU",
        "engine": "vllm",
        "modes": {
            "baseline": {"max_running_requests": 16,
                         "points": [{"concurrency": 1, "decode_tok_s": 480.0, "ttft_s": 0.01},
                                    {"concurrency": 8, "decode_tok_s": 300.0, "ttft_s": 0.02}]},
            "eagle": {"max_running_requests": 16, "accept_length": 3.0,
                      "points": [{"concurrency": 1, "decode_tok_s": 700.0, "ttft_s": 0.01},
                                 {"concurrency": 8, "decode_tok_s": 250.0, "ttft_s": 0.02}]},
        },
    }  # fmt: skip
    profile.write_text(json.dumps(p))
    cfg = tmp_path / "c.yaml"
    rc = specroute(
        ["plan", "--profile", str(profile), "--servers", "2", "--kinds", "baseline,eagle",
         "--concurrency", "1", "4", "--seeds", "0", "1", "--policies", "cost_model", "--loads", "1",
         "--no-progress", "--out", str(cfg)]
    )  # fmt: skip
    assert rc == 0
    text = cfg.read_text()
    assert "sglang" not in text.lower()
    assert "# vLLM launch lines" in text
    assert "python -m vllm.entrypoints.openai.api_server --model MODEL_PATH" in text
    assert "--max-num-seqs 16" in text
    settings = yaml.safe_load(text)
    assert settings["engine"] == "vllm"
    if settings["eagle"]:
        assert '"method":"eagle3"' in text
    cfg.write_text(_fill_placeholders(text))
    check = _cli("check-config", str(cfg))
    assert check.returncode == 0, check.stderr
