"""`DrivenClock.sleep` (the test clock of `serve`, `controller.cli.driven_clock`): a sleep on the
driven clock ends at the advance that moves the clock past its deadline, not before, and by real
time going by as well."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from driven_clock import DrivenClock
from helpers import serve_app


async def test_a_sleep_on_the_driven_clock_ends_at_the_advance_past_its_deadline():
    clock = DrivenClock()
    app = web.Application()
    app.router.add_post(clock.PATH, clock.handle)
    async with serve_app(app) as url, aiohttp.ClientSession() as s:

        async def advance(seconds: float) -> None:
            async with s.post(url + clock.PATH, json={"advance_s": seconds}) as r:
                assert r.status == 200

        sleeper = asyncio.create_task(clock.sleep(60))
        await asyncio.sleep(0.05)
        await advance(30)  # half way: still asleep
        await asyncio.sleep(0.05)
        assert not sleeper.done()
        await advance(31)  # past the deadline: it wakes
        await asyncio.wait_for(sleeper, 1.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await clock.sleep(0.1)  # no advance: real time ends it
        assert loop.time() - t0 >= 0.1
