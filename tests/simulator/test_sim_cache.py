"""Prefix caches in the simulator: the server cache by hand (hits, references, LRU eviction of
leaves), prefill of the uncached tokens only (one prefill at a time), the router's prefix index
reaching policies as `cached_tokens`, the Mooncake trace format and the multi-turn workload.

The Mooncake lines below are written by hand in the format of kvcache-ai/Mooncake's
FAST25-release traces (Apache-2.0; Qin et al., "Mooncake", FAST 2025); the CLI test reads the
real trace from the shared data folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.cli import main
from policies.base import Decision, LoadView, Outcome, RequestInfo
from policies.profile import Profile, parse_profile
from policies.registry import PolicyContext, default_registry
from policies.routing import pool_decision
from simulator.engine.cache import BlockCache
from simulator.engine.deployment import build_deployment, parse_deployment
from simulator.engine.loop import RequestBatch, simulate
from simulator.engine.results import samples, summarize
from simulator.engine.traces import TraceError, detect_format, read_trace
from simulator.engine.workloads import LengthSpec, WorkloadError, WorkloadSpec, generate

MOONCAKE = Path("/work/shared/data/traces/mooncake_conversation_trace.jsonl")


def profile(prefill: float | None = 1000.0, cache_tokens: int | None = 40, ttft: float = 0.1) -> Profile:
    """Baseline and eagle modes at 100 tok/s whatever the load; block size 10 in the tests below."""
    mode: dict[str, Any] = {"points": [{"concurrency": 1, "decode_tok_s": 100.0, "ttft_s": ttft}]}
    if prefill is not None:
        mode["prefill_tok_s"] = prefill
    if cache_tokens is not None:
        mode["cache_tokens"] = cache_tokens
    return parse_profile({"format": "specroute.profile/v1", "modes": {"baseline": mode, "eagle": mode}})


def batch(
    prompts: list[int], blocks: list[tuple[int, ...]], arrivals: list[float], out: int = 11
) -> RequestBatch:
    n = len(prompts)
    return RequestBatch(prompts, [out] * n, [out] * n, [None] * n, [1.0] * n, arrivals, blocks, 10)


def test_block_cache_by_hand() -> None:
    cache = BlockCache(4)
    assert cache.acquire([1, 2, 3]) == 0  # cold
    assert cache.match([1, 2, 9]) == 2 and cache.match([2]) == 1 and cache.match([7, 1]) == 0
    assert cache.acquire([1, 2, 4, 5]) == 2  # shares 1, 2; 5 blocks referenced > capacity 4
    assert len(cache) == 5  # referenced blocks are never evicted
    cache.release([1, 2, 3])
    assert len(cache) == 4 and 3 not in cache  # the only unreferenced block goes at once
    cache.release([1, 2, 4, 5])
    # unreferenced LRU now: 5, 4, 2, 1 (released deepest first, so parents are more recent)
    assert len(cache) == 4 and cache.match([1, 2, 4, 5]) == 4
    assert cache.acquire([1, 6]) == 1
    cache.release([1, 6])
    # capacity 4 with 1, 2, 4, 5, 6 held: the least recently used leaf (5) goes, its parents stay
    assert 5 not in cache and cache.match([1, 2, 4]) == 3 and cache.match([1, 6]) == 2


def test_prefill_only_for_uncached_tokens_one_at_a_time() -> None:
    servers = build_deployment(profile(), parse_deployment("baseline=1"))
    # r0: 30 tokens cold -> prefill 0.03 s; r1 at t=1 shares 2 of its 3 blocks (20 tokens cached,
    # 15 to prefill); r2 arrives with r1 and shares nothing: its prefill waits for r1's.
    b = batch([30, 35, 20], [(1, 2, 3), (1, 2, 4, 5), (8, 9)], [0.0, 1.0, 1.0])
    raw = simulate(servers, None, b)
    assert raw.cached_tokens == [0, 20, 0]
    assert raw.first_token[0] == pytest.approx(0.03 + 0.1)
    assert raw.first_token[1] == pytest.approx(1.0 + 0.015 + 0.1)
    assert raw.first_token[2] == pytest.approx(1.0 + 0.015 + 0.020 + 0.1)
    s = summarize([samples(raw)])
    assert s["cache_hit_ratio"] == pytest.approx(20 / 85)
    assert s["prefill_tokens"] == 65
    assert s["servers"] == {
        "baseline-0": {"requests": 3, "cache_hit_ratio": pytest.approx(20 / 85), "prefill_tokens": 65}
    }


def test_eviction_at_capacity_costs_the_next_turn_its_hit() -> None:
    servers = build_deployment(profile(cache_tokens=40), parse_deployment("baseline=1"))
    # A (blocks 1, 2) has ended when B (3, 4, 5) arrives: 5 blocks > 4, and A's leaf 2 is the least
    # recently used unreferenced block, so it goes; A's next turn finds only block 1.
    b = batch([20, 30, 20], [(1, 2), (3, 4, 5), (1, 2)], [0.0, 1.0, 2.0], out=2)
    raw = simulate(servers, None, b)
    assert raw.cached_tokens == [0, 0, 10]
    unlimited = build_deployment(profile(cache_tokens=1000), parse_deployment("baseline=1"))
    # a whole prompt cached: its last token is still computed, as SGLang reports
    assert simulate(unlimited, None, b).cached_tokens == [0, 0, 19]
    none = build_deployment(profile(cache_tokens=None), parse_deployment("baseline=1"))
    assert simulate(none, None, b).cached_tokens is None  # no cache modelled


class Recorder:
    """Sends each request to the backend the test says and records the cached_tokens it saw."""

    name = "recorder"

    def __init__(self, targets: list[str]) -> None:
        self.targets = targets
        self.seen: list[dict[str, int]] = []

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        backends = view.baseline.backends + view.eagle.backends
        self.seen.append({b.name: b.cached_tokens for b in backends})
        name = self.targets[len(self.seen) - 1]
        return pool_decision(
            "eagle" if name.startswith("eagle") else "baseline", "test", policy=self.name, backend=name
        )

    def observe(self, outcome: Outcome) -> None:
        pass


def test_router_index_sets_cached_tokens_per_decision() -> None:
    servers = build_deployment(profile(), parse_deployment("baseline=1,eagle=1"))
    policy = Recorder(["baseline-0", "eagle-0", "eagle-0", "baseline-0"])
    b = batch([30, 25, 35, 12], [(1, 2, 3), (1, 2, 7), (1, 2, 7, 8), (1, 2)], [0.0, 1.0, 2.0, 3.0])
    raw = simulate(servers, policy, b)
    assert policy.seen == [
        {"baseline-0": 0, "eagle-0": 0},
        {"baseline-0": 20, "eagle-0": 0},
        {"baseline-0": 20, "eagle-0": 30},
        {"baseline-0": 12, "eagle-0": 12},  # never more than the prompt (a partial last block)
    ]
    assert raw.cached_tokens == [0, 0, 30, 11]  # the server cache agrees (its last token is computed)


def test_the_simulation_with_caches_is_deterministic() -> None:
    spec = WorkloadSpec(kind="multiturn", rate=4.0, requests=400, prompt_tokens=LengthSpec("exp", 300))
    prof = profile(prefill=5000.0, cache_tokens=20_000)

    def once() -> tuple[list[float], list[int] | None]:
        policy = default_registry(entry_points=False).create("cost_model", {}, PolicyContext(prof, 3))
        servers = build_deployment(prof, parse_deployment("baseline=2,eagle=2"))
        raw = simulate(servers, policy, generate(spec, 7)[0].batch, seed=3)
        return raw.first_token, None if raw.cached_tokens is None else list(raw.cached_tokens)

    first, again = once(), once()
    assert first == again
    assert first[1] is not None and sum(first[1]) > 0


def write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_mooncake_trace_is_detected_and_parsed(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        [
            '{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}',
            '{"timestamp": 1500, "input_length": 512, "output_length": 0, "hash_ids": [0]}',
        ],
    )
    assert detect_format(p) == "mooncake"
    records = read_trace(p)
    assert [(r.t, r.prompt_tokens, r.output_tokens, r.blocks) for r in records] == [
        (0.0, 1100, 5, (0, 1, 2)),
        (1.5, 512, 1, (0,)),  # an empty answer still produces its first token
    ]
    seg = generate(WorkloadSpec(kind="trace", trace=str(p), time_scale=2.0), 0)[0]
    assert seg.batch.blocks == [(0, 1, 2), (0,)] and seg.batch.block_tokens == 512
    assert seg.batch.arrivals == [0.0, 3.0]
    # overridden prompt lengths no longer match the blocks: no cache data then
    seg = generate(WorkloadSpec(kind="trace", trace=str(p), prompt_tokens=LengthSpec("const", 9)), 0)[0]
    assert seg.batch.blocks is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}', "'timestamp' must be"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [0]}', "'input_length' and 'output_length' are"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0, "x"]}', "list of non-neg"),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0, 1]}',
            "2 hash_ids for input",
        ),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_mooncake_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}'
    p = write(tmp_path, [good, line])
    with pytest.raises(TraceError, match=message) as info:
        read_trace(p, "mooncake")
    assert f"{p}:2" in str(info.value)


def test_multiturn_conversations_grow_and_share_the_system_prompt() -> None:
    spec = WorkloadSpec(
        kind="multiturn",
        rate=1.0,
        requests=300,
        turns=LengthSpec("const", 3),
        think_time_s=5.0,
        system_prompt_tokens=1100,
        prompt_tokens=LengthSpec("const", 100),
        output_tokens=LengthSpec("const", 50),
    )
    b = generate(spec, 5)[0].batch
    assert b == generate(spec, 5)[0].batch  # same seed, same requests
    assert b != generate(spec, 6)[0].batch
    assert b.arrivals is not None and b.blocks is not None and len(b) == 300
    assert list(b.arrivals) == sorted(b.arrivals)
    # every prompt is 1100 + 100 (first turn), 1100 + 150 + 100, or 1100 + 2 x 150 + 100 tokens
    assert set(b.prompt_tokens) == {1200, 1350, 1500}
    system = {blocks[:2] for blocks in b.blocks}
    assert len(system) == 1  # the system prompt's two whole blocks are shared by every session
    third = [blk for blk, p in zip(b.blocks, b.prompt_tokens, strict=True) if p == 1500]
    second = [blk for blk, p in zip(b.blocks, b.prompt_tokens, strict=True) if p == 1350]
    # a later turn extends an earlier one: block 2 was partial (1100..1200, 1100..1350) until the
    # third turn, so each turn's block 2 is new, while the system blocks stay
    assert all(len(blk) == 3 for blk in second + third)
    assert len({blk[2] for blk in second + third}) == len(second) + len(third)
    with pytest.raises(WorkloadError, match="think time"):
        WorkloadSpec(kind="multiturn", think_time_s=-1.0)


SIMULATE = ["simulate", "--profile", "kimi-k25-int4-8gpu", "--json", "--deployment", "baseline=2,eagle=2"]


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"the Mooncake trace is not at {MOONCAKE} (shared data)")
def test_simulate_cli_mooncake(capsys: pytest.CaptureFixture[str]) -> None:
    base = SIMULATE
    policies = [
        "--policy",
        "cost_model",
        "--policy",
        "cost_model:prefix_aware=false",
        "--policy",
        "cache_only",
    ]
    args = [*base, "--workload", "trace", "--trace", str(MOONCAKE), "--requests", "600", "--time-scale", "4"]
    assert main([*args, "--cache-tokens", "5000000", *policies]) == 0
    doc = json.loads(capsys.readouterr().out)
    aware, blind, cache_only = (r["summary"] for r in doc["runs"])
    for s in (aware, blind, cache_only):
        assert 0 < s["cache_hit_ratio"] < 1 and s["prefill_tokens"] > 0
        assert set(s["servers"]) == {"baseline-0", "baseline-1", "eagle-0", "eagle-1"}
        assert sum(v["requests"] for v in s["servers"].values()) == 600
        assert sum(v["prefill_tokens"] for v in s["servers"].values()) == s["prefill_tokens"]
    assert aware["cache_hit_ratio"] > blind["cache_hit_ratio"]
    assert main([*args, "--cache-tokens", "0", "--policy", "cost_model"]) == 0
    off = json.loads(capsys.readouterr().out)["runs"][0]["summary"]
    assert off["cache_hit_ratio"] == 0.0


def test_simulate_cli_multiturn(capsys: pytest.CaptureFixture[str]) -> None:
    mt = [*SIMULATE, "--workload", "multiturn", "--rate", "2", "--requests", "300", "--policy", "round_robin"]
    assert main(mt) == 0
    s = json.loads(capsys.readouterr().out)["runs"][0]["summary"]
    assert s["requests"] == 300 and s["cache_hit_ratio"] > 0.3


def test_the_router_may_believe_a_bigger_cache_than_the_server_has() -> None:
    servers = build_deployment(profile(cache_tokens=20), parse_deployment("baseline=1,eagle=1"))
    policy = Recorder(["baseline-0"] * 3)
    b = batch([20, 20, 20], [(1, 2), (3, 4), (1, 2)], [0.0, 1.0, 2.0], out=2)
    raw = simulate(servers, policy, b, index_cache_tokens=[1000, 1000])
    # the index still holds blocks 1, 2 (it believes 100 blocks fit); the server held 2 and evicted them
    assert policy.seen[2]["baseline-0"] == 20
    assert raw.cached_tokens == [0, 0, 0]


def test_tune_takes_the_cache_size() -> None:
    from simulator.planning.tuner import tune

    prof = profile(prefill=5000.0, cache_tokens=None)
    spec = WorkloadSpec(kind="multiturn", rate=2.0, requests=200)
    hit = {}
    for size in (0, 100_000):
        result = tune(
            prof,
            "cost_model",
            {},
            [("prefix_aware", [True])],
            parse_deployment("baseline=1,eagle=1"),
            spec,
            "mean_e2e_s",
            registry=default_registry(entry_points=False),
            cache_tokens=size,
        )
        hit[size] = result.best.summary["cache_hit_ratio"]
    assert hit[0] == 0.0 and hit[100_000] > 0.3
