"""The request path's timeouts run on the proxy's injected clock: a test moves the clock past a
deadline instead of sleeping for it (`controller.proxy.watchdog`)."""

from __future__ import annotations

import asyncio

import pytest
from fakes import ShiftedClock

from controller.proxy.watchdog import ClockTimeout, RelayWatchdog, Stalled


async def test_a_clock_timeout_fires_when_its_clock_passes_the_deadline_not_before():
    clock = ShiftedClock()
    with pytest.raises(TimeoutError):
        with ClockTimeout(3600.0, clock):
            await asyncio.sleep(0.2)
            clock.advance(3600.0)
            await asyncio.sleep(60)  # cut by the timeout (else no TimeoutError: the test fails)
    with ClockTimeout(3600.0, clock):
        await asyncio.sleep(0.2)  # not over: nothing raised
    with ClockTimeout(None, clock):
        await asyncio.sleep(0.01)  # no limit


async def test_a_clock_timeout_passes_on_a_cancellation_that_is_not_its_own():
    clock = ShiftedClock()

    async def body() -> None:
        with ClockTimeout(3600.0, clock):
            await asyncio.sleep(60)

    task = asyncio.create_task(body())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_on_the_real_clock_a_clock_timeout_fires_on_time():
    with pytest.raises(TimeoutError):
        with ClockTimeout(0.05):
            await asyncio.sleep(60)


async def test_the_watchdog_judges_each_side_by_the_injected_clock():
    clock = ShiftedClock()
    with pytest.raises(Stalled) as stalled:
        with RelayWatchdog(120.0, 30.0, clock) as dog:
            dog.writing(clock())
            clock.advance(20.0)  # blocked on the client, under write_s: not a stall
            await asyncio.sleep(0.2)
            dog.reading(clock(), credit=20.0)
            clock.advance(130.0)  # silent backend: over idle_s, within idle_s + the credit
            await asyncio.sleep(0.2)
            clock.advance(20.0)  # now over idle_s + credit
            await asyncio.sleep(60)
    assert stalled.value.side == "backend" and stalled.value.seconds == 120.0
    with pytest.raises(Stalled) as stalled:
        with RelayWatchdog(120.0, 30.0, clock) as dog:
            dog.writing(clock())
            clock.advance(31.0)
            await asyncio.sleep(60)
    assert stalled.value.side == "client"
