"""What clients learn about the backends: credentials in a backend URL are refused at start-up
(they used to reach x-specroute-backend, error bodies, /metrics and logs, and broke every
client's Authorization); a backend may be named, and its name -- not its URL -- is what clients,
metrics and logs see; `backend_header: false` leaves the header out."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from fakes import closed_port_url
from helpers import BODY, run_specroute

from controller.proxy.config import ConfigError, load_settings

SECRET = "pw-5c1f9e0b"


@pytest.mark.parametrize(
    "url", [f"http://admin:{SECRET}@10.0.0.1:30000", f"gpu=http://u:{SECRET}@10.0.0.1:1"]
)
def test_credentials_in_a_backend_url_are_refused_without_echoing_them(url):
    with pytest.raises(ConfigError) as info:
        load_settings({"baseline": url}, {}, None)
    message = str(info.value)
    assert "carries credentials" in message and "baseline_api_key" in message
    assert SECRET not in message and "admin" not in message


async def test_serve_refuses_a_url_with_credentials(tmp_path):
    code, _, err = await run_specroute("serve", "--baseline", f"http://u:{SECRET}@127.0.0.1:1", timeout_s=60)
    assert code == 2 and "carries credentials" in err and SECRET not in err


def test_names_must_be_unique_and_well_formed():
    with pytest.raises(ConfigError, match="used twice"):
        load_settings({"baseline": "a=http://h:1", "eagle": "a=http://h:2"}, {}, None)
    with pytest.raises(ConfigError, match="backend name"):
        load_settings({"baseline": "bad name=http://h:1"}, {}, None)
    s = load_settings({"baseline": "gpu-0=http://h:1/, http://h:2"}, {}, None)
    assert [(b.name, b.url) for b in s.backends()] == [("gpu-0", "http://h:1"), ("http://h:2", "http://h:2")]


async def test_a_named_backend_shows_its_name_everywhere(fake_backend, proxy, caplog):
    live = await fake_backend()
    dead = closed_port_url()
    p = await proxy(
        baseline=[f"plain-a={live.url}"], eagle=[f"eagle-a={dead}"], policy="fixed",
        policy_params={"pool": "eagle"}, health_checks=False, allow_client_override=True,
    )  # fmt: skip
    async with aiohttp.ClientSession() as s:
        async with s.post(p.url + "/v1/chat/completions", json=BODY) as r:
            await r.read()
            assert r.headers["x-specroute-backend"] == "plain-a"  # failed over from eagle-a
        async with s.post(
            p.url + "/v1/chat/completions", json=BODY, headers={"x-specroute-mode": "eagle"}
        ) as r:
            error = await r.json()
        async with s.get(p.url + "/v1/models") as r:
            assert r.headers["x-specroute-backend"] == "plain-a"
    assert "eagle-a" in error["error"]["message"]
    text = await p.metrics_text()
    for url in (live.url, dead):
        port = url.rsplit(":", 1)[1]
        assert port not in error["error"]["message"]
        assert port not in text
    assert 'backend="plain-a"' in text and 'backend="eagle-a"' in text
    assert dead.rsplit(":", 1)[1] not in caplog.text
    assert live.requests  # the URL is still where requests go


async def test_backend_header_can_be_left_out(fake_backend, proxy):
    fb = await fake_backend()
    p = await proxy(baseline=[fb.url], policy="fixed", health_checks=False, backend_header=False)
    c = openai.AsyncOpenAI(base_url=p.base_url, api_key="k", max_retries=0)
    raw = await c.chat.completions.with_raw_response.create(model="m", messages=BODY["messages"])
    assert "x-specroute-backend" not in raw.headers and raw.headers["x-specroute-pool"] == "baseline"
    stream = await c.chat.completions.with_raw_response.create(
        model="m", messages=BODY["messages"], stream=True
    )
    assert "x-specroute-backend" not in stream.headers
    [_ async for _ in stream.parse()]
    await c.close()
    async with aiohttp.ClientSession() as s, s.get(p.url + "/v1/models") as r:
        assert r.status == 200 and "x-specroute-backend" not in r.headers
