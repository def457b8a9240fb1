"""Security promises: the admin endpoint needs the bearer token and is off without one; secrets
(admin token, client and upstream API keys) and prompt/answer text never reach the logs unless
log_bodies is on; the client's Authorization is forwarded unchanged or replaced per pool (also on
failover); specroute binds 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
import openai
import pytest
from fakes import FakeBackend
from helpers import run_specroute

from controller.proxy.config import Settings, load_settings

ADMIN_TOKEN = "adm-7f3c9e1b5d2a4f60"
CLIENT_KEY = "sk-client-5e8a1c7d9b3f"
EAGLE_KEY = "upstream-eagle-2b6d8f0a"
BASE_KEY = "upstream-base-4c1e7a93"
PROMPT_MARKER = "zebra-quartz-prompt-text"
CHAT = [{"role": "user", "content": f"please answer {PROMPT_MARKER}"}]
REPO = Path(__file__).resolve().parents[2]


async def _status(
    session: aiohttp.ClientSession, method: str, url: str, auth: str | None, json: object = None
) -> tuple[int, dict]:
    headers = {"Authorization": auth} if auth is not None else {}
    async with session.request(method, url, headers=headers, json=json) as r:
        return r.status, await r.json()


async def test_admin_is_off_without_a_token(fake_backend, proxy):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed")
    async with aiohttp.ClientSession() as s:
        for method in ("GET", "POST"):
            for auth in (None, "Bearer anything", "Bearer "):
                status, body = await _status(s, method, p.url + "/admin/policy", auth, {"name": "fixed"})
                assert status == 404 and body["error"]["code"] == "not_found"
        # indistinguishable from a route that does not exist
        status, unknown = await _status(s, "GET", p.url + "/admin/nothing", None)
        assert status == 404 and unknown["error"]["code"] == body["error"]["code"]


@pytest.mark.parametrize(
    "auth",
    [
        None,
        "",
        ADMIN_TOKEN,  # no scheme
        f"Basic {ADMIN_TOKEN}",
        f"Bearer {ADMIN_TOKEN[:-1]}",  # a prefix
        f"Bearer {ADMIN_TOKEN}x",  # longer
        f"Bearer  {ADMIN_TOKEN}",
        f"Bearer {ADMIN_TOKEN.upper()}",
        "Bearer " + "é" * 20,
    ],
)
async def test_admin_rejects_every_wrong_token_with_401(fake_backend, proxy, caplog, auth):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", admin_token=ADMIN_TOKEN)
    async with aiohttp.ClientSession() as s:
        for method in ("GET", "POST"):
            status, body = await _status(s, method, p.url + "/admin/policy", auth, {"name": "threshold"})
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            assert ADMIN_TOKEN not in body["error"]["message"]
        status, body = await _status(s, "GET", p.url + "/admin/policy", f"Bearer {ADMIN_TOKEN}")
        assert status == 200 and body["name"] == "fixed"  # nothing was swapped
    assert ADMIN_TOKEN not in caplog.text
    if auth:
        assert auth not in caplog.text


async def _collect(proc: asyncio.subprocess.Process) -> str:
    assert proc.stderr is not None
    return (await proc.stderr.read()).decode(errors="replace")


async def test_serve_logs_no_secrets_and_no_text(fake_backend, spawn_serve):
    """`specroute serve --log-level DEBUG` as a subprocess, through every path that logs (admin
    auth, policy swap, failover, a backend marked unhealthy, a broken stream, an oversized header):
    its whole stderr holds no token, no key, no prompt and no answer text."""
    base = await fake_backend(chunks=3)
    eagle = await fake_backend(chunks=3)
    dead = FakeBackend()
    dead_url = await dead.start()
    await dead.stop()  # refuses connections from now on
    env = {
        "SPECROUTE_ADMIN_TOKEN": ADMIN_TOKEN,
        "SPECROUTE_EAGLE_API_KEY": EAGLE_KEY,
    }
    sp = await spawn_serve(
        "--baseline", f"{base.url},{dead_url}", "--eagle", eagle.url, "--policy", "fixed",
        "--policy-param", "pool=eagle", "--log-level", "DEBUG", "--health-check-interval-s", "0.2",
        env=env,
    )  # fmt: skip
    client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
    out = await client.chat.completions.create(model="m", messages=CHAT)
    assert out.choices[0].message.content == "tok0 tok1 tok2 "
    assert eagle.request_headers[-1]["Authorization"] == f"Bearer {EAGLE_KEY}"
    eagle.mode = "error500"  # failover to baseline, which gets the client's key
    chunks = [c async for c in await client.chat.completions.create(model="m", messages=CHAT, stream=True)]
    assert chunks[1].choices[0].delta.content == "tok0 "
    assert base.request_headers[-1]["Authorization"] == f"Bearer {CLIENT_KEY}"
    eagle.mode = "die_mid"
    with pytest.raises(openai.APIError):
        async for _ in await client.chat.completions.create(model="m", messages=CHAT, stream=True):
            pass
    await client.close()
    async with aiohttp.ClientSession() as s:
        for auth in ("Bearer wrong-token-91d2", f"Bearer {CLIENT_KEY}", None):
            status, _ = await _status(s, "POST", sp.url + "/admin/policy", auth, {"name": "threshold"})
            assert status == 401
        status, _ = await _status(
            s, "POST", sp.url + "/admin/policy", f"Bearer {ADMIN_TOKEN}", {"name": "fixed", "params": {}}
        )
        assert status == 200
        async with s.get(sp.url + "/v1/models", headers={"Authorization": f"Bearer {CLIENT_KEY}"}) as r:
            assert r.status == 200
    reader, writer = await asyncio.open_connection("127.0.0.1", int(sp.url.rsplit(":", 1)[1]))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + CLIENT_KEY.encode()
        + b"A" * 9000
        + b"\r\n\r\n"
    )
    assert b" 400 " in (await asyncio.wait_for(reader.read(), 10)).split(b"\r\n")[0]
    writer.close()
    sp.signal(signal.SIGTERM)
    assert await sp.wait() == 0
    log = await _collect(sp.proc)
    assert "marked unhealthy" in log or "UNHEALTHY" in log  # the log did capture the failures
    for secret in (ADMIN_TOKEN, CLIENT_KEY, EAGLE_KEY, "wrong-token-91d2", PROMPT_MARKER, "tok0", "tok1"):
        assert secret not in log, f"{secret!r} leaked into the log:\n{log}"


async def test_log_bodies_is_what_puts_prompts_in_the_log(fake_backend, spawn_serve):
    fb = await fake_backend(chunks=2)
    sp = await spawn_serve("--baseline", fb.url, "--policy", "fixed", "--log-bodies", "true")
    client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
    await client.chat.completions.create(model="m", messages=CHAT)
    await client.close()
    sp.signal(signal.SIGTERM)
    assert await sp.wait() == 0
    log = await _collect(sp.proc)
    assert PROMPT_MARKER in log  # explicitly enabled: the request body is logged...
    assert CLIENT_KEY not in log  # ...but never the headers


async def test_authorization_forwarded_unchanged_or_replaced_per_pool(fake_backend, proxy):
    base = await fake_backend(chunks=2)
    eagle = await fake_backend(chunks=2)
    async with aiohttp.ClientSession() as s:
        # default: the client's header goes through byte for byte, on both endpoints and pools
        p = await proxy(baseline=[base.url], eagle=[eagle.url], policy="fixed", allow_client_override=True)
        odd = "Bearer  Mixed.Case-key/with=chars "
        for pool, path, payload in (
            ("baseline", "/v1/chat/completions", {"messages": CHAT}),
            ("eagle", "/v1/completions", {"prompt": "x"}),
        ):
            headers = {
                "Authorization": odd,
                "x-specroute-mode": pool,
                "Proxy-Authorization": "Basic cHJveHk=",
            }
            async with s.post(p.url + path, json={"model": "m", **payload}, headers=headers) as r:
                assert r.status == 200
            seen = (base if pool == "baseline" else eagle).request_headers[-1]
            assert seen["Authorization"] == odd.strip() or seen["Authorization"] == odd
            assert "Proxy-Authorization" not in seen  # hop-by-hop: never forwarded
        # replaced per pool, including after a failover from one pool to the other
        p = await proxy(
            baseline=[base.url],
            eagle=[eagle.url],
            policy="fixed",
            policy_params={"pool": "eagle"},
            baseline_api_key=BASE_KEY,
            eagle_api_key=EAGLE_KEY,
        )
        auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
        async with s.post(
            p.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}, headers=auth
        ):
            pass
        assert eagle.request_headers[-1]["Authorization"] == f"Bearer {EAGLE_KEY}"
        eagle.mode = "error500"
        async with s.post(
            p.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}, headers=auth
        ) as r:
            assert r.status == 200 and r.headers["x-specroute-reason"] == "failover"
        assert eagle.request_headers[-1]["Authorization"] == f"Bearer {EAGLE_KEY}"
        assert base.request_headers[-1]["Authorization"] == f"Bearer {BASE_KEY}"
        async with s.get(p.url + "/v1/models", headers=auth) as r:
            assert r.status == 200
        for h in base.request_headers + eagle.request_headers:
            if h.get("Authorization") in (f"Bearer {BASE_KEY}", f"Bearer {EAGLE_KEY}"):
                assert CLIENT_KEY not in str(h)  # the client's key never reaches a keyed pool


async def test_binds_loopback_unless_told_otherwise(fake_backend, spawn_serve):
    assert Settings().host == "127.0.0.1"
    fb = await fake_backend()
    sp = await spawn_serve("--baseline", fb.url)
    assert sp.url.startswith("http://127.0.0.1:")
    sp.signal()
    assert await sp.wait() == 0
    example = REPO / "deploy" / "specroute.yaml"
    if example.exists():  # the example config binds loopback and says why
        assert load_settings({}, {}, example).host == "127.0.0.1"
        lines = example.read_text().splitlines()
        i = next(i for i, line in enumerate(lines) if line.startswith("host:"))
        assert any("127.0.0.1" in line and line.startswith("#") for line in lines[max(0, i - 3) : i])


async def test_secrets_cannot_be_given_as_flags():
    """Flags show in `ps` and shell history: the admin token and upstream keys have no flag."""
    code, out, _ = await run_specroute("serve", "--help")
    assert code == 0
    for flag in ("--admin-token", "--baseline-api-key", "--eagle-api-key"):
        assert flag not in out
        code, _, err = await run_specroute("serve", "--baseline", "http://127.0.0.1:1", flag, ADMIN_TOKEN)
        assert code == 2 and f"unrecognized arguments: {flag}" in err
        assert "Traceback" not in err


async def test_empty_admin_token_leaves_admin_off(fake_backend, proxy):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", admin_token="")
    async with aiohttp.ClientSession() as s:
        for auth in (None, "Bearer ", "Bearer"):
            status, body = await _status(s, "GET", p.url + "/admin/policy", auth)
            assert status == 404 and body["error"]["code"] == "not_found"


async def test_empty_upstream_key_in_the_environment_forwards_the_clients_header(fake_backend, spawn_serve):
    fb = await fake_backend(chunks=2)
    sp = await spawn_serve("--baseline", fb.url, "--policy", "fixed", env={"SPECROUTE_BASELINE_API_KEY": ""})
    client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
    await client.chat.completions.create(model="m", messages=CHAT)
    await client.close()
    sp.signal(signal.SIGTERM)
    assert await sp.wait() == 0
    assert fb.request_headers[-1]["Authorization"] == f"Bearer {CLIENT_KEY}"


async def test_serve_has_no_route_or_switch_that_moves_its_clock(fake_backend, spawn_serve):
    """Moving the clock would let any client expire every timeout and ejection: only the tests'
    own entry point (`tests/driven_serve.py`) adds such a route, and nothing in the package
    offers one, whatever the environment says."""
    fb = await fake_backend()
    plain = await spawn_serve("--baseline", fb.url, env={"SPECROUTE_TEST_CLOCK": "1"})
    async with aiohttp.ClientSession() as s:
        status, body = await _status(s, "POST", plain.url + "/_test/clock", None, {"advance_s": 60})
        assert status == 404 and body["error"]["code"] == "not_found"


def test_the_package_names_no_test_route_or_switch() -> None:
    for path in (Path(__file__).resolve().parents[2] / "controller").rglob("*.py"):
        text = path.read_text()
        assert "/_test" not in text and "SPECROUTE_TEST" not in text, path
