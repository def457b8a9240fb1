"""Outlier detection and health, Envoy-style: consecutive failures before an ejection, ejections
that grow while a backend keeps failing, a cap on the ejected share of a pool, panic routing when
nothing is left, and probes that need more than one bad answer. The detector is plain code over a
`LoadTracker` (driven here with explicit times); the proxy-level tests use fake backends."""

from __future__ import annotations

import aiohttp
import openai
from helpers import BODY, make_tracker, wait_until

from controller.proxy.load import LoadTracker
from controller.proxy.outlier import OutlierDetector


def _detector(baseline: int = 1, eagle: int = 1, **kw: float) -> tuple[LoadTracker, OutlierDetector]:
    tracker = make_tracker(
        [f"b{i}=http://10.0.0.{i}:1" for i in range(baseline)],
        [f"e{i}=http://10.0.1.{i}:1" for i in range(eagle)],
    )
    params = {"consecutive_failures": 3, "base_s": 10.0, "max_s": 300.0, "max_ejected_percent": 50.0} | kw
    return tracker, OutlierDetector(tracker, **params)  # type: ignore[arg-type]


def test_failures_must_be_consecutive():
    tracker, d = _detector()
    b = tracker.get("b0")
    assert not d.failure(b, 0.0, "x") and not d.failure(b, 0.1, "x")
    d.success(b)  # a success in between starts the count again
    assert not d.failure(b, 0.2, "x") and not d.failure(b, 0.3, "x")
    assert d.failure(b, 0.4, "x")
    assert b.ejected(0.5) and b.ejected(10.3) and not b.ejected(10.4)


def test_ejections_in_a_row_grow_and_decay_with_good_service():
    tracker, d = _detector(consecutive_failures=1, base_s=10.0, max_s=25.0)
    b = tracker.get("b0")
    times = []
    now = 0.0
    for _ in range(4):  # fails again as soon as it is back: 10, 20, 25 (capped), 25
        assert d.failure(b, now, "x")
        assert b.ejected_until is not None
        times.append(b.ejected_until - now)
        now = b.ejected_until
    assert times == [10.0, 20.0, 25.0, 25.0]
    # back for 35 s (3.5 base periods) without failing: the multiplier 4 decays by 3 -> next is 2x
    now += 35.0
    assert d.failure(b, now, "x")
    assert b.ejected_until == now + 20.0


def test_at_most_the_configured_share_of_a_pool_is_ejected():
    tracker, d = _detector(baseline=4, consecutive_failures=1, max_ejected_percent=50.0)
    ejected = [d.failure(tracker.get(f"b{i}"), 0.0, "x") for i in range(4)]
    assert ejected == [True, True, False, False]  # 2 of 4
    tracker, d = _detector(baseline=1, consecutive_failures=1, max_ejected_percent=10.0)
    assert d.failure(tracker.get("b0"), 0.0, "x")  # one backend may always be ejected


def test_panic_routes_to_every_backend_when_none_is_usable():
    tracker, d = _detector(baseline=2, eagle=1, consecutive_failures=1, max_ejected_percent=100.0)
    for name in ("b0", "b1", "e0"):
        d.failure(tracker.get(name), 0.0, "x")
    view = tracker.view(1.0)
    assert all(b.usable for b in (*view.baseline.backends, *view.eagle.backends))  # panic: all usable
    tracker.panic = False
    view = tracker.view(1.0)
    assert not any(b.usable for b in (*view.baseline.backends, *view.eagle.backends))
    tracker.panic = True
    tracker.get("e0").ejected_until = None  # one is back: no panic, the ejected stay out
    view = tracker.view(1.0)
    assert [b.usable for b in view.baseline.backends] == [False, False] and view.eagle.backends[0].usable


async def test_panic_mode_serves_when_every_backend_looks_down(fake_backend, proxy):
    """Both backends fail their probes (a probe path that 503s) but serve completions fine: with
    panic routing requests are served; without, everything would be 503."""
    base = await fake_backend(chunks=2)
    eagle = await fake_backend(chunks=2)
    base.health_status = eagle.health_status = 503
    p = await proxy(baseline=[base.url], eagle=[eagle.url], policy="threshold", health_check_interval_s=0.05)
    assert await wait_until(lambda: not any(b.healthy for b in p.tracker), 5)
    c = openai.AsyncOpenAI(base_url=p.base_url, api_key="k", max_retries=0)
    out = await c.chat.completions.create(model="m", messages=BODY["messages"])
    assert out.choices[0].message.content == "tok0 tok1 "
    await c.close()
    async with aiohttp.ClientSession() as s, s.get(p.url + "/ready") as r:
        assert r.status == 503  # readiness still says no backend is healthy


async def test_one_failed_probe_does_not_take_a_backend_out(fake_backend, proxy):
    """The rounds are counted by the probes the backend received, not timed by sleeps (a round's
    answer is chosen as its probe arrives, and the count is polled ten times a round)."""
    fb = await fake_backend()
    p = await proxy(
        baseline=[fb.url], policy="fixed", health_check_interval_s=0.05, health_check_unhealthy_threshold=3,
        health_check_healthy_threshold=50,  # once out, it would stay out through the rounds below
    )  # fmt: skip

    async def rounds(n: int) -> None:
        """Until `n` more probes have reached the backend."""
        seen = len(fb.probes)
        assert await wait_until(lambda: len(fb.probes) >= seen + n, 5, interval_s=0.005)

    assert await wait_until(lambda: p.tracker.get(fb.url).healthy, 2)
    await rounds(3)  # several passing rounds
    fb.health_status = 503
    await rounds(1)  # one failed round (the next probe may come before the poll sees it: two)
    fb.health_status = 200
    await rounds(3)  # and passing ones after it: the failed one has been counted by now
    assert p.tracker.get(fb.url).healthy  # a blip is not a failure
    fb.health_status = 503
    assert await wait_until(lambda: not p.tracker.get(fb.url).healthy, 5)  # a lasting one is


async def test_probes_use_ready_and_fall_back_to_health_where_it_is_missing(fake_backend, proxy):
    new = await fake_backend()
    old = await fake_backend(ready_route=False)  # an SGLang release without /ready
    p = await proxy(baseline=[new.url, old.url], policy="fixed", health_check_interval_s=0.05)
    assert await wait_until(lambda: len(new.probes) >= 3 and old.probes.count("/health") >= 2, 5)
    assert set(new.probes) == {"/ready"}  # the cheap probe: no generation on SGLang
    assert set(old.probes) == {"/health"}  # /ready answered 404 once (not counted here), then /health
    assert p.tracker.get(old.url).healthy and p.tracker.get(new.url).healthy
