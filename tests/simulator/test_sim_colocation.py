"""Co-located servers: a profile mode's together points slow a simulated server while its partner
(the other mode's server of the same index) has running requests; exact times on small cases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.cli import main
from policies.profile import ProfileError, load_profile, parse_profile
from policies.together import describe, slowdowns, together_mode
from simulator.engine.colocation import ColocatedServer, pairs, server_types
from simulator.engine.deployment import build_deployment, parse_deployment, server_profile
from simulator.engine.loop import RequestBatch, simulate
from simulator.engine.oracle import best_static_split
from simulator.engine.server import Server


def mode(
    alone: list[tuple[int, float, float]], together: list[tuple[int, float, float]] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "max_running_requests": 16,
        "points": [{"concurrency": c, "decode_tok_s": d, "ttft_s": t} for c, d, t in alone],
    }
    if together is not None:
        out["together"] = {
            "points": [{"concurrency": c, "decode_tok_s": d, "ttft_s": t} for c, d, t in together]
        }
    return out


def pair_profile(together: bool = True) -> dict[str, Any]:
    """Both modes 100 tok/s alone, 50 tok/s while the other is busy (TTFT 0)."""
    t = [(1, 50.0, 0.0)] if together else None
    eagle = {**mode([(1, 100.0, 0.0)], t), "accept_length": 2.0}
    return {
        "format": "specroute.profile/v1",
        "name": "pair",
        "modes": {"baseline": mode([(1, 100.0, 0.0)], t), "eagle": eagle},
    }


def two_requests(gap: float) -> RequestBatch:
    """Two requests of 101 output tokens (100 decode steps each), `gap` seconds apart."""
    return RequestBatch(
        prompt_tokens=[10, 10], output_tokens=[101, 101], max_tokens=[None, None], hints=[None, None],
        accept=[1.0, 1.0], arrivals=[0.0, gap],
    )  # fmt: skip


def test_a_server_slows_exactly_while_its_partner_is_busy() -> None:
    servers = build_deployment(parse_profile(pair_profile()), parse_deployment("baseline=1,eagle=1"))
    raw = simulate(servers, None, two_requests(0.5), seed=0)  # least loaded: one request each
    assert sorted(raw.server) == [0, 1]
    # first: 50 tokens alone (0.5 s), the other 50 at half speed (1 s); second: 50 at half speed
    # until the first is done, then 50 alone (0.5 s)
    assert raw.finish == pytest.approx([1.5, 2.0], abs=1e-9)
    alone = build_deployment(
        parse_profile(pair_profile(together=False)), parse_deployment("baseline=1,eagle=1")
    )
    assert simulate(alone, None, two_requests(0.5), seed=0).finish == pytest.approx([1.0, 1.5], abs=1e-9)
    # one after the other: never both busy, alone speed
    assert simulate(servers, None, two_requests(1.5), seed=0).finish == pytest.approx([1.0, 2.5], abs=1e-9)


def test_without_together_points_every_server_is_the_plain_one() -> None:
    plain = build_deployment(
        parse_profile(pair_profile(together=False)), parse_deployment("baseline=2,eagle=2")
    )
    assert server_types(plain) == [Server] * 4 and pairs(plain) == []
    co = build_deployment(parse_profile(pair_profile()), parse_deployment("baseline=2,eagle=1,adaptive=2"))
    # baseline-0 with eagle-0, then the rest two by two: baseline-1 with adaptive-0; adaptive-1 alone
    assert pairs(co) == [(0, 2), (1, 3)]
    assert server_types(co) == [ColocatedServer, ColocatedServer, ColocatedServer, ColocatedServer, Server]


@pytest.mark.parametrize("kind", ["baseline", "eagle", "adaptive"])
def test_two_servers_of_one_kind_share_the_hardware_as_a_pair_does(kind: str) -> None:
    """A plan compares a co-located pair with two plain, two EAGLE or two adaptive servers on the
    same hardware: those slow each other alike (an adaptive one as its two modes do)."""
    servers = build_deployment(parse_profile(pair_profile()), parse_deployment(f"{kind}=2"))
    assert pairs(servers) == [(0, 1)]
    raw = simulate(servers, None, two_requests(0.5), seed=0)
    assert sorted(raw.server) == [0, 1]
    assert raw.finish == pytest.approx([1.5, 2.0], abs=1e-9)  # as the pair's (test above)
    alone = build_deployment(parse_profile(pair_profile(together=False)), parse_deployment(f"{kind}=2"))
    assert pairs(alone) == []
    assert simulate(alone, None, two_requests(0.5), seed=0).finish == pytest.approx([1.0, 1.5], abs=1e-9)


def test_one_sided_together_points_slow_only_that_mode() -> None:
    data = pair_profile()
    del data["modes"]["eagle"]["together"]
    servers = build_deployment(parse_profile(data), parse_deployment("baseline=1,eagle=1"))
    raw = simulate(servers, None, two_requests(0.5), seed=0)
    first_on_baseline = raw.server[0] == 0
    # the request on the baseline server is slowed while the other runs, the eagle one never
    expected = [1.5, 1.5] if first_on_baseline else [1.0, 1.75]
    assert raw.finish == pytest.approx(expected, abs=1e-9)


def test_the_together_curve_from_sparse_points() -> None:
    data = mode([(1, 100.0, 0.1), (4, 50.0, 0.4)], [(1, 60.0, 0.2)])
    data["prefill_tok_s"] = 1000.0
    spec = parse_profile({"format": "specroute.profile/v1", "modes": {"baseline": data}}).mode("baseline")
    assert slowdowns(spec) == [(1.0, pytest.approx(0.6), pytest.approx(2.0))]
    slowed = together_mode(spec)
    assert slowed is not None and slowed.together is None
    # one factor for every batch size: the alone curve times 0.6, TTFT times 2, prefill times 0.6
    assert [(p.concurrency, p.decode_tok_s, p.ttft_s) for p in slowed.points] == [
        (1.0, pytest.approx(60.0), pytest.approx(0.2)), (4.0, pytest.approx(30.0), pytest.approx(0.8)),
    ]  # fmt: skip
    assert slowed.prefill_tok_s == pytest.approx(600.0)
    # two together points: the factor is interpolated between them, held beyond
    data["together"]["points"].append({"concurrency": 4, "decode_tok_s": 40.0, "ttft_s": 0.0})
    spec = parse_profile({"format": "specroute.profile/v1", "modes": {"baseline": data}}).mode("baseline")
    factors = slowdowns(spec)
    assert factors[1] == (4.0, pytest.approx(0.8), pytest.approx(1.25))  # TTFT 0 measured: 1 / f
    slowed = together_mode(spec)
    assert slowed is not None and slowed.points[1].decode_tok_s == pytest.approx(40.0)
    assert together_mode(parse_profile(pair_profile(together=False)).mode("eagle")) is None


def test_server_speed_scales_the_together_points_alike() -> None:
    belief = parse_profile(pair_profile())
    truth = server_profile(belief, speed={"baseline": 0.5})
    assert slowdowns(truth.mode("baseline")) == slowdowns(belief.mode("baseline"))
    together = truth.mode("baseline").together
    assert together is not None and together.points[0].decode_tok_s == pytest.approx(25.0)


def test_profile_validation_checks_the_together_points() -> None:
    data = pair_profile()
    data["modes"]["baseline"]["together"]["points"].append({"concurrency": 1, "decode_tok_s": 40.0})
    with pytest.raises(ProfileError, match="duplicate concurrency"):
        parse_profile(data, "p.json")
    data = pair_profile()
    data["modes"]["eagle"]["together"]["points"][0]["decode_tok_s"] = 0
    with pytest.raises(ProfileError, match=r"modes\.eagle\.together\.points\.0\.decode_tok_s"):
        parse_profile(data, "p.json")
    data = pair_profile()
    data["modes"]["eagle"]["together"] = {"points": []}
    with pytest.raises(ProfileError, match=r"together\.points"):
        parse_profile(data, "p.json")
    round_trip = parse_profile(json.loads(parse_profile(pair_profile()).to_json()))
    assert round_trip == parse_profile(pair_profile())


def write(path: Path, data: dict[str, Any]) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_profile_merge_together_and_simulate_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    both = pair_profile(together=False)
    a = write(tmp_path / "a.json", {**both, "modes": {"baseline": both["modes"]["baseline"]}})
    b = write(tmp_path / "b.json", {**both, "modes": {"eagle": both["modes"]["eagle"]}})
    busy = {"points": [{"concurrency": 1, "decode_tok_s": 50.0, "ttft_s": 0.0}]}
    measured = {
        "format": "specroute.profile/v1", "name": "both busy", "measured_together": True,
        "modes": {"baseline": busy, "eagle": busy},
    }  # fmt: skip
    t = write(tmp_path / "t.json", measured)
    out = tmp_path / "pair.json"
    assert main(["profile", "merge", a, b, "--together", t, "-o", str(out)]) == 0
    printed = capsys.readouterr()
    assert "baseline x0.50 at c=1; eagle x0.50 at c=1" in printed.out and printed.err == ""
    merged = load_profile(out)
    assert merged.mode("baseline").together == parse_profile(pair_profile()).mode("baseline").together
    assert "together points from" in merged.source
    # added to an already merged profile: one input; a second time: an error
    again = tmp_path / "again.json"
    assert (
        main(["profile", "merge", write(tmp_path / "p.json", both), "--together", t, "-o", str(again)]) == 0
    )
    capsys.readouterr()
    assert main(["profile", "merge", str(out), "--together", t, "-o", str(tmp_path / "x.json")]) == 2
    assert "both" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
    # a profile that lacks a mode of the together one; one input without --together
    assert main(["profile", "merge", a, "--together", t, "-o", str(tmp_path / "x.json")]) == 2
    assert "has a 'eagle' mode but the profiles merged have none" in capsys.readouterr().err
    assert main(["profile", "merge", a, "-o", str(tmp_path / "x.json")]) == 2
    capsys.readouterr()
    # a --together profile that does not say it was measured together: merged, with a warning
    unmarked = write(tmp_path / "u.json", {k: v for k, v in measured.items() if k != "measured_together"})
    assert main(["profile", "merge", a, b, "--together", unmarked, "-o", str(tmp_path / "u2.json")]) == 0
    assert "does not say it was measured together" in capsys.readouterr().err

    # simulate uses it and says so, in the table's heading and in --json (with a note on stderr)
    args = ["simulate", "--profile", str(out), "--policy", "round_robin", "--concurrency", "2",
            "--requests-per-level", "10", "--warmup-requests", "2",
            "--output-tokens", "const:101"]  # fmt: skip
    assert main(args) == 0
    described = describe(merged)
    assert described is not None and described in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    printed = capsys.readouterr()
    doc = json.loads(printed.out)
    assert doc["colocation"]["eagle"] == [{"concurrency": 1.0, "decode_factor": 0.5, "ttft_factor": 2.0}]
    assert "co-located pairs" in printed.err
    level = doc["runs"][0]["levels"][0]
    assert level["mean_decode_tok_s"] == pytest.approx(50.0, rel=0.02)  # both always busy: half speed
    plain = write(tmp_path / "plain.json", both)
    assert main([*args[:2], plain, *args[3:], "--json"]) == 0  # no together points: no colocation key
    assert "colocation" not in json.loads(capsys.readouterr().out)


def test_the_oracle_knows_a_split_pair_runs_at_its_together_speed() -> None:
    # alone: 100 tok/s with one request, 80 with two; together: 50 (c=1)
    data = pair_profile()
    for spec in data["modes"].values():
        spec["points"].append({"concurrency": 2, "decode_tok_s": 80.0, "ttft_s": 0.0})
    slowing = parse_profile(data)
    batch = RequestBatch(
        prompt_tokens=[10] * 4, output_tokens=[101] * 4, max_tokens=[None] * 4, hints=[None] * 4,
        accept=[1.0] * 4,
    )  # fmt: skip
    co = build_deployment(slowing, parse_deployment("baseline=1,eagle=1"))
    best = best_static_split(co, 2, batch)
    # one on each: 2 x 101 / (100 / 50) = 101 tok/s; both on one server: 2 x 101 / (100 / 80) = 161.6
    assert best.throughput_tok_s == pytest.approx(161.6) and sorted(best.split) == [0, 2]
    for spec in data["modes"].values():
        del spec["together"]
    alone = build_deployment(parse_profile(data), parse_deployment("baseline=1,eagle=1"))
    best = best_static_split(alone, 2, batch)
    assert best.throughput_tok_s == pytest.approx(202.0) and best.split == (1, 1)
    # a pair and an unpaired server: the pair's split and the third server's clients
    three = build_deployment(slowing, parse_deployment("baseline=2,eagle=1"))
    best = best_static_split(three, 2, batch)
    assert best.throughput_tok_s == pytest.approx(202.0)  # one on the unpaired baseline, one in the pair
    assert best.split[1] == 1 and best.split[0] + best.split[2] == 1
