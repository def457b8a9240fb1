"""Adaptive speculation ladders (`policies.ladder`): SGLang's buckets and EMA controller, vLLM's
schedules, the forms settings and command lines give, and what each engine reports about itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policies.adaptive import DepthModel
from policies.ladder import (
    SGLANG_DEFAULT,
    Bucket,
    Ladder,
    LadderError,
    accepted_drafts,
    from_sglang_server_info,
    from_vllm_schedule,
    from_vllm_server_info,
    next_steps,
    parse_ladder,
)
from policies.profile import resolve_profile

KIMI_ALPHA = DepthModel.of(resolve_profile("kimi-k25-int4-8gpu").mode("eagle")).alpha  # ~0.665


def test_sglang_default_ladder_settles_by_batch_size() -> None:
    assert SGLANG_DEFAULT.describe() == "1:1/3/5/7,8:0/1/3,32:0/1,64:0"
    assert SGLANG_DEFAULT.initial == 3  # the middle of 0/1/3/5/7, SGLang's pick when not given
    depths = {b: SGLANG_DEFAULT.depths_at(b, KIMI_ALPHA) for b in (1, 7, 8, 31, 32, 63, 64, 500)}
    assert depths == {1: (3,), 7: (3,), 8: (3,), 31: (3,), 32: (1,), 63: (1,), 64: (0,), 500: (0,)}
    assert SGLANG_DEFAULT.off_from() == 64
    # a drafter accepting almost everything climbs past 3 steps at small batches (EMA 2.71 > 2.5)
    assert SGLANG_DEFAULT.depths_at(1, 0.95) == (5,)
    # one accepting half its drafts or less: 1 step is no better than none below batch 64, so the
    # controller drops to 0 and probes 1 again every decision: half its steps each
    assert SGLANG_DEFAULT.depths_at(40, 0.5) == (1, 0)
    assert SGLANG_DEFAULT.depths_at(8, 0.3) == (1, 0)


def test_next_steps_is_sglang_s_rule_by_hand() -> None:
    b = Bucket(8, (0, 1, 3), down_hysteresis=0.0)
    assert next_steps(b, 3, 1.4) == (3, 1.4)  # 1.4 > 1 - 0.5: no step down; 3 is the top
    # at most 1 - 0.5: down to 1, and at most 0.5 (the threshold towards 0 steps) on to 0
    assert next_steps(b, 3, 0.5) == (0, 0.5)
    # from 5 with 2.0 accepted: at most 3 - 0.5 - 0.25 (down to 3), above 1 - 0.5 - 0.25 (not to 1)
    assert next_steps(Bucket(1, (1, 3, 5, 7), down_hysteresis=-0.25), 5, 2.0) == (3, 2.0)
    assert next_steps(b, 1, 0.6) == (3, 0.6)  # 0.6 > 1 - 0.5: up
    assert next_steps(b, 0, -1.0) == (1, 0.0)  # at 0 it probes the next, its EMA from neutral
    assert next_steps(Bucket(64, (0,)), 0, 0.0) == (0, 0.0)
    assert accepted_drafts(0.5, 3) == pytest.approx(0.875)


def test_vllm_schedules_as_vllm_reads_them() -> None:
    ladder = from_vllm_schedule([[1, 16, 3], [33, 64, 2], [65, 128, 0]])
    assert ladder.engine == "vllm"
    # a gap carries the previous range's k; beyond the last range its k holds
    assert [ladder.depths_at(b, 0.7) for b in (1, 16, 20, 33, 64, 65, 4000)] == [
        (3,), (3,), (3,), (2,), (2,), (0,), (0,),
    ]  # fmt: skip
    assert from_vllm_schedule([[1, 8, 5]], max_steps=3).depths_at(1, 0.7) == (3,)
    for bad, why in (
        ([], "non-empty"),
        ([[2, 8, 3]], "start at batch 1"),
        ([[1, 8, 3], [8, 16, 0]], "overlap"),
        ([[1, 8, -1]], "k >= 0"),
        ([[1, 8, 1, 1, 3]], "5-item"),
        ([[1, 8.5, 3]], "integers"),
    ):
        with pytest.raises(LadderError, match=why):
            from_vllm_schedule(bad)


def test_the_vllm_schedule_of_a_ladder_is_what_it_settles_at() -> None:
    assert SGLANG_DEFAULT.vllm_schedule(KIMI_ALPHA, 256) == [[1, 31, 3], [32, 63, 1], [64, 256, 0]]
    fixed = from_vllm_schedule([[1, 20, 2], [21, 256, 0]])
    assert fixed.vllm_schedule(0.7, 100) == [[1, 20, 2], [21, 100, 0]]


def test_parse_ladder_forms(tmp_path: Path) -> None:
    assert parse_ladder("sglang") is SGLANG_DEFAULT and parse_ladder("Default") is SGLANG_DEFAULT
    assert parse_ladder("off") is None and parse_ladder(" none ") is None
    compact = parse_ladder("1:3/5,64:0")
    assert compact is not None and compact.describe() == "1:3/5,64:0" and compact.engine == "sglang"
    vllm = parse_ladder("[[1,32,3],[33,64,2],[65,128,0]]")
    assert vllm is not None and vllm.engine == "vllm" and vllm.describe() == "1:3,33:2,65:0"
    assert parse_ladder([[1, 8, 2]]) == from_vllm_schedule([[1, 8, 2]])
    config = {
        "update_interval": 3,
        "1": {"candidate_steps": [1, 3]},
        "16": {"candidate_steps": [0], "ema_alpha": 0.5},
    }
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(config))
    from_file = parse_ladder(str(path))
    assert from_file is not None and from_file.describe() == "1:1/3,16:0"
    assert [b.update_interval for b in from_file.buckets] == [3, 3]
    assert [b.ema_alpha for b in from_file.buckets] == [0.2, 0.5]
    assert [b.down_hysteresis for b in from_file.buckets] == [-0.25, -0.25]  # SGLang's default knob
    inline = parse_ladder(json.dumps(config))
    assert inline is not None and inline.same_depths(from_file)
    for bad, why in (
        ("", "empty"),
        ("1:x", "MIN_BATCH:STEPS"),
        ("8:1,4:0", "increasing"),
        ("1:20", "at most 16"),
        ('{"strategy": "throughput_aware", "1": {"candidate_steps": [1]}}', "not modelled"),
        ('{"x": 1}', "no bucket"),
        ('{"1": {"candidate_steps": []}}', "candidate_steps"),
        ("{not json", "not valid JSON"),
        (str(tmp_path / "missing.json"), "cannot read"),
    ):
        with pytest.raises(LadderError, match=why):
            parse_ladder(bad)


def test_cuda_graph_padding_moves_a_batch_into_the_next_bucket() -> None:
    sizes = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72)
    ladder = Ladder(SGLANG_DEFAULT.buckets, graph_sizes=sizes)
    assert ladder.bucket_at(5).min_batch == 8  # padded to 8
    assert ladder.bucket_at(57).min_batch == 64  # padded to 64: no drafting from batch 57
    assert ladder.bucket_at(100).min_batch == 64  # beyond the largest graph: unpadded
    assert SGLANG_DEFAULT.bucket_at(57).min_batch == 32


def test_what_sglang_reports_on_server_info() -> None:
    base = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_adaptive": True}
    reported = from_sglang_server_info({**base, "speculative_adaptive_config": None})
    assert reported is not None and reported.note is None and reported.ladder is not None
    assert reported.ladder.same_depths(Ladder(SGLANG_DEFAULT.buckets, initial_steps=3))
    graphs = from_sglang_server_info({**base, "cuda_graph_bs": [4, 1, 8], "disable_cuda_graph": False})
    assert graphs is not None and graphs.ladder is not None and graphs.ladder.graph_sizes == (1, 4, 8)
    custom = from_sglang_server_info({**base, "speculative_adaptive_config": "/etc/sglang/ladder.json"})
    assert custom is not None and custom.ladder is not None
    assert custom.note is not None and "/etc/sglang/ladder.json" in custom.note
    assert "backend_adaptive" in custom.note
    off = from_sglang_server_info({**base, "speculative_adaptive": False})
    assert off is not None and off.ladder is None
    assert from_sglang_server_info({**base, "speculative_algorithm": "NGRAM"}) == off
    assert from_sglang_server_info({"speculative_algorithm": "EAGLE3"}) is None  # an older SGLang
    assert from_sglang_server_info([1, 2]) is None


def test_what_vllm_reports_on_its_development_server_info() -> None:
    spec = {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 8, 3], [9, 64, 0]]}
    reported = from_vllm_server_info({"vllm_config": {"speculative_config": spec}})
    assert reported is not None and reported.ladder is not None
    assert reported.ladder.describe() == "1:2,9:0"  # k capped at num_speculative_tokens
    fixed = from_vllm_server_info({"vllm_config": {"speculative_config": {"num_speculative_tokens": 3}}})
    assert fixed is not None and fixed.ladder is None
    plain = from_vllm_server_info({"vllm_config": {"speculative_config": None}})
    assert plain is not None and plain.ladder is None
    broken = from_vllm_server_info(
        {"vllm_config": {"speculative_config": {"num_speculative_tokens_per_batch_size": [[3, 4, 1]]}}}
    )
    assert broken is not None and broken.ladder is None and broken.note is not None
    assert from_vllm_server_info({"vllm_config": "text form"}) is None
