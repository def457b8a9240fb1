"""Parsing SGLang's load signals (`/metrics` text and `/v1/loads` JSON) and the decision log."""

from __future__ import annotations

import json
from pathlib import Path

from controller.proxy.decision_log import DecisionLog
from controller.proxy.scrape import merge_samples, parse_sglang_metrics, parse_v1_loads

# Shaped as SGLang 0.5.x prints it: colons in names, one sample per rank.
SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 7.0
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 7.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 5.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.5
sglang:spec_accept_length{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 3.5
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 300.0
sglang:gen_throughput{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 200.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 2.0
sglang:time_to_first_token_seconds_sum{model_name="m"} 0.3
sglang:time_to_first_token_seconds_count{model_name="m"} 2.0
"""


def test_metrics_sum_data_parallel_ranks_not_tensor_parallel_copies() -> None:
    s = parse_sglang_metrics(SGLANG_METRICS, taken_at=12.5)
    assert s is not None
    # dp0 reports 7 from two tensor-parallel ranks (one scheduler), dp1 reports 5.
    assert s.running == 12.0
    assert s.queued == 3.0
    assert s.accept_length == 3.0
    assert s.gen_throughput == 500.0
    assert s.taken_at == 12.5


def test_metrics_without_scheduler_gauges_or_garbage_give_none() -> None:
    assert parse_sglang_metrics("# nothing here\n", 0.0) is None
    assert parse_sglang_metrics("this is {not prometheus", 0.0) is None
    # A plain server without speculation reports accept length 0: treated as unknown.
    plain = 'sglang:num_running_reqs{tp_rank="0"} 1\nsglang:spec_accept_length{tp_rank="0"} 0\n'
    s = parse_sglang_metrics(plain, 0.0)
    assert s is not None and s.accept_length is None and s.queued == 0.0


def test_v1_loads_and_merge_prefers_fresher_loads() -> None:
    loads = parse_v1_loads(
        {
            "loads": [
                {"dp_rank": 0, "num_running_reqs": 4, "num_waiting_reqs": 1, "gen_throughput": 50.0},
                {"dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 0, "gen_throughput": 25.0},
            ]
        },
        taken_at=3.0,
    )
    assert loads is not None and (loads.running, loads.queued, loads.gen_throughput) == (6.0, 1.0, 75.0)
    metrics = parse_sglang_metrics(SGLANG_METRICS, taken_at=2.0)
    merged = merge_samples(metrics, loads)
    assert merged is not None
    assert (merged.running, merged.queued, merged.taken_at) == (6.0, 1.0, 3.0)
    assert merged.accept_length == 3.0  # filled in from /metrics
    assert parse_v1_loads({"loads": "nope"}, 0.0) is None
    assert parse_v1_loads([{"num_running_reqs": "x"}], 0.0) is None


def test_decision_log_writes_json_lines_and_rotates(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    dl = DecisionLog(path, max_bytes=2000, backups=2)
    for i in range(100):
        dl.write({"ts": float(i), "pool": "eagle", "status": "ok", "n": i})
    dl.write({"bad": float("nan")})  # not JSON: dropped, counted, never written
    dl.close()
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["decisions.jsonl", "decisions.jsonl.1", "decisions.jsonl.2"]
    assert all(f.stat().st_size <= 2000 for f in files)
    lines = [json.loads(line) for f in reversed(files) for line in f.read_text().splitlines()]
    # The oldest records were rotated away; what is kept is contiguous and ends with the last.
    ns = [r["n"] for r in lines]
    assert ns == list(range(ns[0], 100))
    assert dl.dropped == 1
