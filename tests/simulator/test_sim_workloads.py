"""Workload generators and trace readers of the simulator."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from simulator.engine.traces import TraceError, detect_format, read_trace
from simulator.engine.workloads import LengthSpec, WorkloadError, WorkloadSpec, generate

AZURE_CONV = Path("/work/shared/data/traces/AzureLLMInferenceTrace_conv.csv")


def test_length_specs_have_the_stated_means() -> None:
    rng = random.Random(1)
    assert LengthSpec.parse("const:200").draw(rng, 3) == [200, 200, 200]
    for text, mean in (("exp:150", 150.0), ("lognormal:300,0.7", 300.0)):
        draws = LengthSpec.parse(text).draw(rng, 100_000)
        assert min(draws) >= 1
        assert sum(draws) / len(draws) == pytest.approx(mean, rel=0.02)
    for bad in ("const", "const:0", "exp:-1", "lognormal:5", "uniform:1,2", "exp:x"):
        with pytest.raises(WorkloadError):
            LengthSpec.parse(bad)


@pytest.mark.parametrize("kind", ["poisson", "bursty"])
def test_open_loop_arrivals_have_the_mean_rate(kind: str) -> None:
    spec = WorkloadSpec(kind=kind, rate=20.0, requests=60_000, burst_factor=5.0, burst_period_s=2.0)  # type: ignore[arg-type]
    arrivals = generate(spec, 3)[0].batch.arrivals
    assert arrivals is not None
    assert arrivals == sorted(arrivals)
    assert len(arrivals) / arrivals[-1] == pytest.approx(20.0, rel=0.05)


def test_bursty_is_burstier_than_poisson() -> None:
    def dispersion(kind: str) -> float:
        spec = WorkloadSpec(kind=kind, rate=20.0, requests=40_000, burst_factor=8.0, burst_period_s=5.0)  # type: ignore[arg-type]
        arrivals = generate(spec, 4)[0].batch.arrivals
        assert arrivals is not None
        counts = [0] * (int(arrivals[-1]) + 1)
        for t in arrivals:
            counts[int(t)] += 1
        mean = sum(counts) / len(counts)
        return sum((c - mean) ** 2 for c in counts) / len(counts) / mean

    assert dispersion("poisson") == pytest.approx(1.0, abs=0.15)
    assert dispersion("bursty") > 3.0


def test_the_same_workload_whatever_the_policy_and_a_new_one_per_seed() -> None:
    spec = WorkloadSpec(kind="poisson", requests=500, output_tokens=LengthSpec("exp", 100))
    a, b, c = generate(spec, 1)[0].batch, generate(spec, 1)[0].batch, generate(spec, 2)[0].batch
    assert a == b
    assert a.output_tokens != c.output_tokens


def test_sweep_levels_are_independent_segments() -> None:
    spec = WorkloadSpec(kind="sweep", levels=(1, 10), requests_per_level=30, warmup=5)
    segments = generate(spec, 0)
    assert [s.concurrency for s in segments] == [1, 10]
    assert all(s.warmup == 5 and s.measure == 30 and s.batch.arrivals is None for s in segments)
    assert all(len(s.batch) >= 5 + 30 + s.concurrency for s in segments if s.concurrency)


def test_azure_trace_is_read_relative_to_its_first_request() -> None:
    if not AZURE_CONV.is_file():
        pytest.skip("Azure trace not available")
    assert detect_format(AZURE_CONV) == "azure"
    records = read_trace(AZURE_CONV, limit=100)
    assert len(records) == 100
    assert records[0].t == 0.0
    assert records[1].t == pytest.approx(4.3145790)  # 18:15:50.9951690 - 18:15:46.6805900
    assert (records[0].prompt_tokens, records[0].output_tokens) == (374, 44)
    assert all(b.t >= a.t for a, b in itertools.pairwise(records))


def test_trace_time_scale_stretches_arrivals(tmp_path: Path) -> None:
    csv = tmp_path / "t.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:00:00.0000000,10,5\n"
        "2023-11-16 18:00:02.5000000,20,0\n"
        "2023-11-16 18:00:01.0000000,30,7\n"
    )
    batch = generate(WorkloadSpec(kind="trace", trace=str(csv), time_scale=2.0), 0)[0].batch
    assert batch.arrivals == [0.0, 2.0, 5.0]
    assert list(batch.prompt_tokens) == [10, 30, 20]
    assert list(batch.output_tokens) == [5, 7, 1]  # at least one token each
    override = WorkloadSpec(kind="trace", trace=str(csv), output_tokens=LengthSpec("const", 9))
    assert list(generate(override, 0)[0].batch.output_tokens) == [9, 9, 9]


def test_decision_log_replay_uses_arrival_order_and_fallbacks(tmp_path: Path) -> None:
    lines = [
        {"ts": 100.5, "prompt_tokens": 7, "max_tokens": 50, "completion_tokens": None, "hint": "code"},
        {"ts": 100.0, "prompt_tokens": 3, "max_tokens": None, "completion_tokens": 12, "hint": None},
        {"ts": 101.0, "prompt_tokens": 9, "max_tokens": None, "completion_tokens": None, "hint": "prose"},
    ]
    log = tmp_path / "d.jsonl"
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert detect_format(log) == "specroute-log"
    spec = WorkloadSpec(kind="trace", trace=str(log))
    batch = generate(spec, 0)[0].batch
    assert batch.arrivals == [0.0, 0.5, 1.0]
    assert list(batch.prompt_tokens) == [3, 7, 9]
    assert list(batch.output_tokens) == [12, 50, 200]  # completion, else max_tokens, else the default
    assert list(batch.hints) == [None, "code", "prose"]


def test_unreadable_traces_are_clear_errors(tmp_path: Path) -> None:
    odd = tmp_path / "odd.txt"
    odd.write_text("hello,world\n1,2\n")
    with pytest.raises(TraceError, match="--trace-format"):
        read_trace(odd)
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(empty)
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"\xff\xfe\x00\x01" * 10)
    with pytest.raises(TraceError):
        read_trace(binary)
