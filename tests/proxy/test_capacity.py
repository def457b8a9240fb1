"""The capacity object, the memory budget and the outlier rules as plain code, with explicit
times (no sleeps): a queue-full back-off keeps a backend out of routing until its deadline and
is never an outlier failure; a timeout counts only when the backend served nobody since; a
request's memory charge grows, is refused past the budget and is released once."""

from __future__ import annotations

import asyncio

import pytest
from helpers import make_tracker
from prometheus_client import CollectorRegistry

from controller.proxy.capacity import AdmissionMetrics, Capacity
from controller.proxy.errors import BadRequest
from controller.proxy.load import LoadTracker
from controller.proxy.memory import Charge, MemoryBudget
from controller.proxy.outlier import OutlierDetector


def _capacity(now: list[float], **kw: float) -> tuple[LoadTracker, Capacity]:
    tracker = make_tracker(["b0=http://10.0.0.1:1", "b1=http://10.0.0.2:1"], ["e0=http://10.0.1.1:1"])
    params = {"wait_s": 5.0, "max_waiting": 10, "backoff_s": 1.0} | kw
    cap = Capacity(
        tracker,
        AdmissionMetrics(CollectorRegistry()),
        clock=lambda: now[0],
        **params,  # type: ignore[arg-type]
    )
    return tracker, cap


def test_a_queue_full_backs_the_backend_off_until_its_deadline():
    now = [100.0]
    tracker, cap = _capacity(now)
    cap.back_off(tracker.get("b0"), now[0])
    admitting = [b.name for p in ("baseline", "eagle") for b in tracker.view(100.5).pool(p).admitting]
    assert admitting == ["b1", "e0"] and not tracker.view(100.5).pool("baseline").backends[0].admits
    admitting = [b.name for p in ("baseline", "eagle") for b in tracker.view(101.0).pool(p).admitting]
    assert admitting == ["b0", "b1", "e0"]  # back at its deadline
    assert tracker.get("b0").healthy and not tracker.get("b0").ejected(100.5)  # never ill, never out


def test_reserve_move_and_release_keep_exact_counts_and_release_once():
    now = [0.0]
    tracker, cap = _capacity(now)
    r = cap.reserve("b0", 10)
    r = cap.move(r, "e0")
    assert (tracker.get("b0").in_flight, tracker.get("e0").in_flight) == (0, 1)
    cap.release(r)
    cap.release(r)
    assert tracker.total_in_flight == 0 and tracker.get("e0").in_flight_tokens == 0


async def test_a_released_slot_wakes_the_waiter_that_may_use_it():
    now = [0.0]
    tracker, cap = _capacity(now)
    tracker.set_bounds({"b0": 1, "b1": 1, "e0": 1}, {"baseline": None, "eagle": None})
    held = [cap.reserve(n) for n in ("b0", "b1", "e0")]
    waiter = asyncio.create_task(cap.admit(None, now[0]))
    await asyncio.sleep(0)  # let it queue (no time passes: the fake clock stands still)
    assert cap.waiting == 1 and not waiter.done()
    cap.release(held[1])
    assert await waiter == 0.0  # woken by the release, not by a timer
    for r in held:
        cap.release(r)


def test_a_timeout_counts_only_when_the_backend_served_nobody_since():
    tracker = make_tracker(["b0=http://10.0.0.1:1", "b1=http://10.0.0.2:1"], [])
    d = OutlierDetector(tracker, consecutive_failures=1, base_s=10.0, max_s=300.0, max_ejected_percent=100.0)
    b = tracker.get("b0")
    d.progress(b, 5.0)  # another request's first byte at t=5
    assert not d.timeout(b, sent_at=4.0, now=10.0, why="long generation")  # it served others meanwhile
    assert b.ejected_until is None
    assert d.timeout(b, sent_at=6.0, now=12.0, why="silent")  # nothing since t=6: slow for all
    assert b.ejected_until == 22.0


def test_the_memory_budget_refuses_past_its_limit_and_a_charge_releases_once():
    budget = MemoryBudget(100)
    a, b = Charge(budget), Charge(budget)
    assert a.grow_to(60) and a.grow_to(80) and budget.used == 80
    assert not b.grow_to(30) and budget.used == 80 and budget.refusals == 1
    a.shrink_to(50)
    assert b.grow_to(30) and budget.used == 80
    a.release()
    a.release()
    b.release()
    assert budget.used == 0


async def test_waiting_charges_get_the_budget_in_arrival_order_and_a_cancelled_one_takes_nothing():
    budget = MemoryBudget(100)
    holder, first, second, third = (Charge(budget) for _ in range(4))
    assert holder.grow_to(90)
    waits = [asyncio.ensure_future(c.grow_to_waiting(n)) for c, n in ((first, 50), (second, 40), (third, 10))]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waits) and budget.used == 90  # the third fits, but waits its turn
    waits[1].cancel()
    holder.shrink_to(40)  # 60 free: the first (50) is handed its bytes, the third (10) too
    await asyncio.sleep(0)
    assert waits[0].done() and waits[2].done() and waits[1].cancelled()
    assert (first.held, second.held, third.held) == (50, 0, 10) and budget.used == 100
    assert budget.refusals == 0  # waiting is not refusing
    for c in (holder, first, third):
        c.release()
    assert budget.used == 0


# --- issue 37, finding 2: a request holds as many slots as it runs sequences -------------------


async def test_a_request_of_several_sequences_waits_until_they_all_fit():
    now = [0.0]
    tracker, cap = _capacity(now)
    tracker.set_bounds({"b0": 4, "b1": 4, "e0": 4}, {"baseline": None, "eagle": None})
    held = [cap.reserve(n, 0, (), 3) for n in ("b0", "b1", "e0")]  # one slot left on each
    assert not cap.blocked(None, now[0]) and cap.blocked(None, now[0], 2)
    assert all(b.full for p in ("baseline", "eagle") for b in tracker.view(0.0, sequences=2).pool(p).backends)
    waiter = asyncio.create_task(cap.admit(None, now[0], 2))
    await asyncio.sleep(0)
    assert cap.waiting == 1
    cap.release(held[1])  # b1 frees 3: the 2 sequences fit there
    assert await waiter == 0.0
    (b1,) = (b for b in tracker.view(0.0, sequences=2).baseline.backends if b.name == "b1")
    assert b1.admits and b1.in_flight == 0
    for r in held:
        cap.release(r)
    assert tracker.total_in_flight == 0


async def test_a_freed_slot_goes_to_the_oldest_waiter_that_fits_not_to_a_larger_one_ahead():
    now = [0.0]
    tracker, cap = _capacity(now)
    tracker.set_bounds({"b0": 2, "b1": 2, "e0": 2}, {"baseline": None, "eagle": None})
    held = [cap.reserve(n) for n in ("b0", "b1", "e0") for _ in range(2)]
    large = asyncio.create_task(cap.admit(None, now[0], 2))
    await asyncio.sleep(0)
    small = asyncio.create_task(cap.admit(None, now[0], 1))
    await asyncio.sleep(0)
    assert cap.waiting == 2
    cap.release(held[0])  # one slot on b0: the 2-sequence request ahead does not fit in it
    await asyncio.sleep(0)
    assert small.done() and small.result() == 0.0  # woken by the release (no timer: no time passed)
    assert not large.done() and cap.waiting == 1
    cap.release(held[1])  # now b0 has two
    assert await large == 0.0
    for r in held:
        cap.release(r)


async def test_a_request_of_more_sequences_than_any_bound_is_refused_at_once():
    """It could never be admitted: a 400 naming `n` instead of a wait that can only end in 429."""
    now = [0.0]
    tracker, cap = _capacity(now)
    tracker.set_bounds({"b0": 4, "b1": 4, "e0": 6}, {"baseline": None, "eagle": 5})
    with pytest.raises(BadRequest) as e:
        await cap.admit(None, now[0], 6)  # eagle's backend takes 6, but its pool only 5
    assert e.value.param == "n" and "at most 5 at once" in e.value.message
    assert cap.waiting == 0
    assert await cap.admit("eagle", now[0], 5) == 0.0  # fits: not even blocked
    with pytest.raises(BadRequest):
        await cap.admit("baseline", now[0], 5)
