"""Issue 37, finding 1 (the proxy's side): a client that reads slowly must not teach the policy
that the backend is slow. The probe: streams with the shared system prompt "You are a helpful
assistant.", routed by `cost_model` (content-aware) to EAGLE-3, each answer read at 32 KB per
second; about 5 such outcomes used to move every client with that system prompt to the plain
pool.

Here on 127.0.0.1 through the real proxy, with the proxy's clock injected (`ShiftedClock`):
the slow reader's second passes on the proxy's clock only while the relay is blocked writing to
it, so the time it costs is exactly known and nothing depends on the machine's speed. Every
such second is counted in the outcome's `client_blocked_s` (the last write's included), the
outcome does not teach (`policies.routing.teaches`), the policy learned nothing from it, and
the other clients are still routed to EAGLE-3. Streams of the same family whose reader keeps
up do teach (the same run's reference: the counters the test reads do move)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest
from fakes import ShiftedClock
from helpers import KIMI, port_of, raw_post, wait_until

from policies.cost_model import CostModelPolicy
from policies.routing import teaches

SYSTEM = "You are a helpful assistant."
READ_BYTES, READ_S = 256 * 1024, 8.0
"""The slow reader takes READ_BYTES per READ_S seconds of the proxy's clock: 32 KB/s."""
ANSWER_TOKENS = 4000
"""~1 MB of events from the fake backend: more than the socket buffers hold (`_small_buffers`)."""


def fast_eagle_profile(path: Path) -> str:
    """The kimi profile with an EAGLE-3 server twice as fast at every load: every request of
    these clients belongs on it while it is idle (its path)."""
    doc = KIMI.model_dump(mode="json", exclude_none=True)
    for point in doc["modes"]["eagle"]["points"]:
        point["decode_tok_s"] *= 2
    path.write_text(json.dumps(doc))
    return str(path)


def _small_buffers(p: Any) -> None:
    """The proxy's sockets to its clients get a send buffer of 16 KB (accepted sockets inherit
    the listener's): on loopback the kernel would otherwise take megabytes of an answer before
    a write blocks, where a real network's path holds far less."""
    for site in p.runner.sites:
        for sock in site._server.sockets:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)


def _body(tokens: int, text: str, stream: bool) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        "max_tokens": tokens,
        "stream": stream,
        "logprobs": True,
        "top_logprobs": 20,
    }


async def _read(p: Any, clock: ShiftedClock, body: dict[str, Any], slow: bool) -> tuple[str, float]:
    """One streamed request over a socket with a small receive buffer, read to its end; the pool
    that served it and the seconds the proxy's clock was moved while its relay was blocked. A
    slow reader (`slow`, on an answer from the eagle pool) takes `READ_BYTES` per `READ_S`."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    head, data, owed, advanced = b"", bytearray(), 0, 0.0

    def blocked() -> bool:
        return p.sample("specroute_client_writes_blocked") == 1.0

    try:
        await loop.sock_connect(sock, ("127.0.0.1", port_of(p.url)))
        await loop.sock_sendall(sock, raw_post("/v1/chat/completions", json.dumps(body).encode()))
        async with asyncio.timeout(120):
            while not data.endswith(b"0\r\n\r\n"):
                chunk = await loop.sock_recv(sock, 1 << 16)
                if not chunk:
                    break
                data += chunk
                if not head and b"\r\n\r\n" in data:
                    head = bytes(data[: data.index(b"\r\n\r\n")]).lower()
                if slow and b"x-specroute-pool: eagle" in head:
                    owed += len(chunk)
                    if owed >= READ_BYTES:  # READ_S after each READ_BYTES, the relay waiting on us
                        owed = 0
                        assert await wait_until(lambda: blocked() or not p.tracker.total_in_flight, 30, 0.001)
                        if blocked():
                            clock.advance(READ_S)
                            advanced += READ_S
    finally:
        sock.close()
    assert data.startswith(b"HTTP/1.1 200") and b"[DONE]" in data[-64:]
    pool = "eagle" if b"x-specroute-pool: eagle" in head else "baseline"
    return pool, advanced


async def _victims(p: Any, n: int) -> list[tuple[str, dict[str, float]]]:
    """`n` other clients' requests with the same system prompt, through the official client: the
    pool each was served by (`x-specroute-pool`) and the end-to-end seconds the policy predicted
    for it on each pool (what its routing, and so its e2e, follows from)."""
    client = p.client()
    seen = []
    for i in range(n):
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=_body(64, f"question {i}", False)["messages"], max_tokens=64
        )
        assert raw.parse().choices[0].message.content
        await p.wait_idle()
        seen.append((raw.headers["x-specroute-pool"], dict(p.records[-1].chosen.predicted_e2e_s)))
    await client.close()
    return seen


def _pools(seen: list[tuple[str, dict[str, float]]]) -> list[str]:
    return [pool for pool, _ in seen]


def _taught(policy: CostModelPolicy) -> tuple[int, int]:
    """Outcomes the eagle pool's calibration and the content model have learned from."""
    cal, content = policy.calibration, policy.content
    assert cal is not None and content is not None
    return cal.pool["eagle"].n, content.model.taught


async def test_a_slow_reader_teaches_nothing_and_the_others_stay_on_eagle(
    fake_backend: Any, proxy: Any, tmp_path: Path
) -> None:
    base = await fake_backend(name="base", chunks=ANSWER_TOKENS)
    spec = await fake_backend(name="spec", chunks=ANSWER_TOKENS, speculative=True)
    clock = ShiftedClock()
    p = await proxy(
        baseline=[base.url], eagle=[spec.url], policy="cost_model",
        profile=fast_eagle_profile(tmp_path / "fast-eagle.json"),
        policy_params={"explore_budget": 0}, health_checks=False, clock=clock,
        client_write_timeout_s=120, idle_timeout_s=120,
    )  # fmt: skip
    policy = p.forwarder.policy
    assert isinstance(policy, CostModelPolicy)
    assert _pools(await _victims(p, 4)) == ["eagle"] * 4

    # the reference: streams read as they come teach (paced as a backend's are: the reader keeps up)
    taught = _taught(policy)
    for i in range(2):
        paced = _body(400, f"fast {i}", True) | {"fake_delay_s": 0.001}
        assert (await _read(p, clock, paced, slow=False))[0] == "eagle"
    await p.wait_idle()
    assert all(teaches(r.outcome) for r in p.records[-2:])
    assert _taught(policy)[0] == taught[0] + 2
    before = await _victims(p, 4)
    assert _pools(before) == ["eagle"] * 4

    # the attack: six answers read at 32 KB per second of the proxy's clock
    _small_buffers(p)
    taught = _taught(policy)
    for i in range(6):
        pool, advanced = await _read(p, clock, _body(ANSWER_TOKENS, f"slow {i}", True), slow=True)
        await p.wait_idle()
        outcome = p.records[-1].outcome
        assert pool == "eagle" and outcome.status == "ok"
        assert advanced >= 16.0  # ~1 MB at 32 KB/s, most of it while the relay waited
        # every blocked second is the client's, the last write's included: what is left is the
        # backend's (and this machine's) real time, far below a second per blocked second
        assert outcome.client_blocked_s >= advanced
        assert outcome.duration_s - outcome.client_blocked_s < advanced / 2
        assert not teaches(outcome)
    assert _taught(policy) == taught  # nothing learned from them
    after = await _victims(p, 4)
    assert _pools(after) == ["eagle"] * 4
    # the same questions are predicted as before the attack on both pools
    for (_, was), (_, now) in zip(before, after, strict=True):
        assert set(now) == {"baseline", "eagle"} and now == pytest.approx(was, rel=1e-9)
