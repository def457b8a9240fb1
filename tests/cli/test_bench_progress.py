"""The bench's progress and ETA (controller.bench.progress) and its queue watch, on a fake clock."""

from __future__ import annotations

import io
import math

import pytest

from controller.bench.progress import (
    PRIOR_DOUBLING_CLIENTS,
    SETTLED_REQUESTS,
    LevelPoint,
    SweepProgress,
    fmt_duration,
    level_point,
    level_rounds,
    predict_e2e_s,
)
from controller.bench.queue_watch import queued_requests
from controller.bench.result import RequestResult


def test_level_rounds_follow_the_runner_rule() -> None:
    assert level_rounds(1, 5, 30) == 35  # one after another: warm-up, then measured
    assert level_rounds(1, 0, 30) == 30
    for c in (2, 3, 7, 16):
        assert level_rounds(c, 0, 30) == math.ceil(30 / c)
    # every client starts as warm-up; once 5 are done the next 30 starts are measured
    assert level_rounds(250, 5, 30) == 2
    assert level_rounds(30, 5, 30) == 3  # 25 measured in the second round, 5 in the third


def _pt(c: int, ttft: float, step: float, tokens: float = 101.0, rel_var: float = 1e-4) -> LevelPoint:
    return LevelPoint(c, ttft, step, rel_var, tokens)


def test_level_point_from_requests() -> None:
    reqs = [
        RequestResult(
            "measured", 0.0, ttft_s=0.2, first_token_s=0.2, last_token_s=1.2, end_s=1.2, completion_tokens=101
        ),
        RequestResult(
            "filler", 0.0, ttft_s=0.4, first_token_s=0.4, last_token_s=0.9, end_s=0.9, completion_tokens=51
        ),
        RequestResult("measured", 0.0, end_s=0.1, error="HTTP 500"),
    ]
    p = level_point(4, reqs)
    assert p is not None and p.concurrency == 4
    assert p.ttft_s == pytest.approx(0.3) and p.tokens == pytest.approx(76.0)
    assert p.step_s == pytest.approx(1.5 / 150)  # token-weighted: 1.5 s over 150 tokens
    assert p.e2e_s == pytest.approx(0.3 + 75 * 0.01)
    assert level_point(1, reqs[2:]) is None


def test_predict_e2e_from_ttft_and_decode_step_lines() -> None:
    assert predict_e2e_s([], 4) is None
    one = [_pt(1, 0.2, 0.01)]
    assert predict_e2e_s(one, 1) == pytest.approx(0.2 + 100 * 0.01)  # a level run is its own answer
    # one level: a token's decode time grows by its own value every PRIOR_DOUBLING_CLIENTS clients
    assert predict_e2e_s(one, 8) == pytest.approx(0.2 + 100 * 0.01 * (1 + 7 / PRIOR_DOUBLING_CLIENTS))
    # two levels and more: least-squares lines, TTFT and step each
    pts = [_pt(1, 0.2, 0.010), _pt(11, 0.3, 0.020), _pt(21, 0.4, 0.030)]
    assert predict_e2e_s(pts, 101) == pytest.approx(1.2 + 100 * 0.110)
    # a noisy level (wide spread) weighs little against precise ones
    noisy = [*pts[:2], _pt(16, 0.35, 0.040, rel_var=1.0), pts[2]]
    assert predict_e2e_s(noisy, 101) == pytest.approx(1.2 + 100 * 0.110, rel=0.01)
    # never a falling line
    assert predict_e2e_s([_pt(1, 0.2, 0.02), _pt(10, 0.2, 0.01)], 50) == pytest.approx(0.2 + 100 * 0.015)
    # above max_running_requests 48 the excess waits: e2e grows with c / 48 ...
    at_48 = predict_e2e_s(pts, 48)
    assert at_48 is not None and predict_e2e_s(pts, 96, cap=48) == pytest.approx(2 * at_48)
    # ... from the last level at or above the cap when there is one, whose queueing TTFT and flat
    # step do not bend the lines below the cap
    queued = _pt(100, 20.0, 0.05)
    assert predict_e2e_s([*pts, queued], 250, cap=48) == pytest.approx(queued.e2e_s * 2.5)
    assert predict_e2e_s([*pts, queued], 30, cap=48) == predict_e2e_s(pts, 30)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _done(lv: object, ttft: float, tokens: int, step: float, start: float = 0.0) -> None:
    """Report one finished request to a LevelState."""
    end = start + ttft + (tokens - 1) * step
    r = RequestResult("measured", start, ttft_s=ttft, first_token_s=start + ttft, last_token_s=end, end_s=end,
                      completion_tokens=tokens)  # fmt: skip
    lv.finished.append(r)  # type: ignore[attr-defined]
    lv.e2e_sum_s += end - start  # type: ignore[attr-defined]
    lv.e2e_n += 1  # type: ignore[attr-defined]


def test_eta_of_level_and_sweep_and_the_lines_a_log_gets() -> None:
    clock, out = Clock(), io.StringIO()  # StringIO is no terminal: plain lines, no bar
    p = SweepProgress([1, 2, 4], requests_per_level=4, warmup=0, label="plain", clock=clock, stream=out)
    lv = p.start_level(1)
    assert p.sweep_eta_s() is None  # nothing known yet
    p.tick()
    assert "ETA level ?, sweep ?" in out.getvalue()
    # one request done: 0.2 s + 100 tokens x 18 ms = 2 s; level 1 = 4 x 2 s
    lv.measured_started = lv.measured_done = 1
    _done(lv, 0.2, 101, 0.018)
    clock.t = 2.0
    assert p.level_eta_s() == pytest.approx(6.0)
    d2, d4 = (0.2 + 100 * 0.018 * (1 + k / PRIOR_DOUBLING_CLIENTS) for k in (1, 3))  # the prior's
    assert p.sweep_eta_s() == pytest.approx(6.0 + d2 * (2 + 0.5) + d4 * (1 + 0.75))
    clock.t = 8.0
    p.end_level(level_point(1, lv.finished))
    lv = p.start_level(2)
    _done(lv, 0.2, 101, 0.028)  # 3 s at concurrency 2: 10 ms more per token per client
    # its first finishers do not speak for it yet (they are its shortest): the prior still does
    assert p.level_duration_s(4) == pytest.approx(d4 * (1 + 0.75))
    for _ in range(SETTLED_REQUESTS - 1):
        _done(lv, 0.2, 101, 0.028)
    assert p.level_duration_s(4) == pytest.approx((0.2 + 100 * 0.048) * (1 + 0.75))
    # every measured request started: what is left is their time in flight plus the drain
    lv.measured_started, lv.measured_done, lv.in_flight = 4, 2, 2
    lv.measured_starts = {1: 8.0, 2: 9.0}
    lv.starts = dict(lv.measured_starts)
    clock.t = 10.0
    assert lv.phase == "finishing"
    assert p.level_eta_s() == pytest.approx((3.0 - 1.0) + 3.0 * 0.5)
    lv.measured_done = 4  # measured all done: the fillers in flight drain
    lv.measured_starts = {}
    lv.starts = {3: 9.5}
    assert lv.phase == "draining" and p.level_eta_s() == pytest.approx(2.5)
    clock.t = 30.0
    assert p.level_eta_s() == 0.0  # late, never negative
    p.tick()
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("bench plain: level 2/3 concurrency 2 draining: measured 4/4 done")
    assert "2 in flight" in lines[-1] and "ETA level 0 s" in lines[-1]
    assert "\r" not in out.getvalue()


def test_log_lines_are_spaced_and_a_new_level_writes_at_once() -> None:
    clock, out = Clock(), io.StringIO()
    p = SweepProgress([1, 2], requests_per_level=2, warmup=0, label=None, clock=clock, stream=out)
    p.start_level(1)
    for step in range(21):  # ticks every 0.5 s for 10 s
        clock.t = step * 0.5
        p.tick()
    assert [ln.split(":")[0] for ln in p.lines] == [
        "bench level 1/2 concurrency 1 measuring"
    ] * 3  # 0, 4, 8 s
    p.end_level(None)
    p.start_level(2)
    p.tick()
    assert len(p.lines) == 4 and "level 2/2" in p.lines[-1]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar() -> None:
    out = Terminal()
    p = SweepProgress([3], requests_per_level=5, warmup=1, label="eagle", clock=Clock(), stream=out)
    lv = p.start_level(3)
    lv.measured_done, lv.in_flight = 2, 3
    p.tick()
    p.end_level(None)
    text = out.getvalue()
    assert "eagle: concurrency 3" in text and "2/5" in text and "3 in flight" in text and "\r" in text
    assert p.lines == []


def test_disabled_progress_writes_nothing() -> None:
    out = io.StringIO()
    p = SweepProgress(
        [1], requests_per_level=1, warmup=0, label=None, clock=Clock(), stream=out, enabled=False
    )
    p.start_level(1)
    p.tick()
    assert out.getvalue() == ""


def test_fmt_duration() -> None:
    assert [fmt_duration(x) for x in (None, 4.4, 75, 3725)] == ["?", "4 s", "1 min 15 s", "1 h 02 min"]


SGLANG_METRICS = """# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0"} 7.0
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="1",pp_rank="0"} 3.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0"} 48.0
"""
SPECROUTE_METRICS = """# TYPE specroute_backend_queued_requests gauge
specroute_backend_queued_requests{pool="eagle",backend="e"} 2.0
# TYPE specroute_admission_waiting_requests gauge
specroute_admission_waiting_requests 1.0
"""


def test_queued_requests_from_sglang_and_specroute_metrics() -> None:
    assert queued_requests(SGLANG_METRICS) == 10.0
    assert queued_requests(SPECROUTE_METRICS) == 3.0
    assert queued_requests("") is None
    assert queued_requests("<html>not found</html>") is None
