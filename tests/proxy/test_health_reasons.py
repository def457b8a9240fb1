"""A backend's change of health is logged with why: how many probes failed in a row and what
the last one saw (the status it answered, the connection refused, no answer in time), and the
probe that passed when it comes back."""

from __future__ import annotations

import asyncio
import logging

from helpers import wait_until


async def test_unhealthy_and_healthy_again_say_why(fake_backend, proxy, caplog):
    fb = await fake_backend()
    gone = await fake_backend()
    await gone.stop()  # refuses connections
    with caplog.at_level(logging.WARNING, "specroute.health"):
        p = await proxy(
            baseline=[fb.url], eagle=[gone.url], policy="fixed", health_check_interval_s=0.05,
            health_check_unhealthy_threshold=2,
        )  # fmt: skip
        assert await wait_until(lambda: not p.tracker.get(gone.url).healthy, 5)
        assert await wait_until(lambda: len(fb.probes) >= 2, 5)
        fb.health_status = 503
        assert await wait_until(lambda: not p.tracker.get(fb.url).healthy, 5)
        fb.health_status = 200
        assert await wait_until(lambda: p.tracker.get(fb.url).healthy, 5)
    lines = [r.getMessage() for r in caplog.records if "is now" in r.getMessage()]
    first = "is now UNHEALTHY: the first health probe failed (last: GET /ready: cannot connect ("
    assert f"backend {gone.url} {first}" in lines[0]
    assert "Connect call failed" in lines[0] or "refused" in lines[0].lower(), lines[0]
    failed = "is now UNHEALTHY: 2 health probe(s) in a row failed (last: GET /ready answered 503)"
    assert f"backend {fb.url} {failed}" in lines
    assert (
        f"backend {fb.url} is now healthy: 1 health probe(s) in a row passed (GET /ready answered 200)"
        in lines
    )


async def test_a_probe_that_gets_no_answer_in_time_says_so(proxy, caplog):
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads the probe, never answers, until the proxy hangs up
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        with caplog.at_level(logging.WARNING, "specroute.health"):
            p = await proxy(
                baseline=[url], policy="fixed", health_check_interval_s=0.05, health_check_timeout_s=0.2,
            )  # fmt: skip
            assert await wait_until(lambda: not p.tracker.get(url).healthy, 5)
        assert (
            "UNHEALTHY: the first health probe failed (last: GET /ready: no answer within 0.2 s)"
            in caplog.text
        )
    finally:
        server.close()
