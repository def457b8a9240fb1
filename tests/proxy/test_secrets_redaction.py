"""Secrets never reach stderr or a log line (issue 25, row D): a YAML syntax error on a line that
holds a secret used to be printed with that line (PyYAML quotes it), and so did a SIGHUP storm
over such a file. The tests run the real `serve` and `check-config` and search everything they
wrote for the secret values."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal

import aiohttp
import pytest
from helpers import metric_samples, run_specroute, wait_until

from controller.proxy.config import ConfigError, load_settings
from controller.proxy.redact import MASK, RedactingFilter, Redactor, secrets_in_yaml

TOKEN = "adm-7f3a91c2e4"
BASE_KEY = "sk-base-0b8e55d1"
EAGLE_KEY = "sk-eagle-93ac10fe"
NEW_KEY = "sk-new-4d2f77b0"
SECRETS = (TOKEN, BASE_KEY, EAGLE_KEY, NEW_KEY)

# Each file has a YAML syntax error on (or right around) the line holding a secret.
BROKEN = {
    "unclosed quote": f'baseline: [http://127.0.0.1:1]\nadmin_token: "{TOKEN}\npolicy: fixed\n',
    "colon in value": f"baseline: [http://127.0.0.1:1]\nbaseline_api_key: {BASE_KEY}: x\n",
    "bad indent": f"baseline: [http://127.0.0.1:1]\n  eagle_api_key: {EAGLE_KEY}\n bad: 1\n",
    "tab": f"baseline: [http://127.0.0.1:1]\nadmin_token:\t{TOKEN}\n\t- x\n",
    "flow": f"{{baseline: [http://127.0.0.1:1], baseline_api_key: '{BASE_KEY}', policy: [}}\n",
    "block scalar": f"baseline: [http://127.0.0.1:1]\nadmin_token: |\n  {TOKEN}\npolicy: {{\n",
}


def _clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"secret {secret} in: {text}"


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_yaml_error_on_a_secret_line_is_reported_without_it(tmp_path, case):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BROKEN[case])
    with pytest.raises(ConfigError) as info:
        load_settings({}, {}, cfg)
    message = str(info.value)
    assert "not valid YAML" in message and "line " in message, message
    _clean(message)


def test_validation_errors_do_not_echo_secrets(tmp_path):
    cfg = tmp_path / "c.yaml"
    # the secret is valid YAML but lands where it is echoed: an unknown key, a bad URL
    cfg.write_text(f"baseline: ['http//u:{BASE_KEY}@h:1']\nadmin_token: {TOKEN}\n")
    with pytest.raises(ConfigError) as info:
        load_settings({}, {"SPECROUTE_EAGLE_API_KEY": EAGLE_KEY}, cfg)
    assert "baseline" in str(info.value)
    _clean(str(info.value))
    cfg.write_text(f"baseline: [http://h:1]\n{TOKEN}: 1\n")  # pasted into the wrong place
    with pytest.raises(ConfigError, match="unknown key"):
        load_settings({}, {"SPECROUTE_ADMIN_TOKEN": TOKEN}, cfg)


def test_redactor_masks_every_known_secret_and_only_those():
    found = secrets_in_yaml(f'admin_token: "{TOKEN}"  # x\nbaseline_api_key: {BASE_KEY}\nport: 8000\n')
    redact = Redactor(found)
    assert redact(f"a {TOKEN} b {BASE_KEY} 8000") == f"a {MASK} b {MASK} 8000"
    assert Redactor(["abc"])("abc") == "abc"  # too short to be searched for
    # YAML's null, booleans and comments are no secret values
    assert secrets_in_yaml("admin_token: null\neagle_api_key: ~ # env\nbaseline_api_key:  # env\n") == set()


def test_the_log_filter_masks_messages_arguments_and_tracebacks():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RedactingFilter(Redactor([TOKEN])))
    logger = logging.getLogger("test.redaction")
    logger.addHandler(handler)
    try:
        logger.error("token %s in an argument", TOKEN)
        try:
            raise ValueError(f"token {TOKEN} in an exception")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert "in an argument" in text and "in an exception" in text and text.count(MASK) == 2
    _clean(text)


@pytest.mark.parametrize("case", ["unclosed quote", "colon in value", "block scalar"])
async def test_serve_and_check_config_print_no_secret(tmp_path, case):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BROKEN[case])
    env = {**os.environ, "SPECROUTE_EAGLE_API_KEY": EAGLE_KEY}
    code, out, err = await run_specroute("serve", "--config", str(cfg), env=env, timeout_s=60)
    assert code == 2 and "not valid YAML" in err, err
    _clean(out + err)
    code, out, err = await run_specroute("check-config", str(cfg), env=env, timeout_s=60)
    assert code == 2 and "not valid YAML" in err, err
    _clean(out + err)


async def test_sighup_storm_over_broken_files_logs_no_secret(fake_backend, spawn_serve, tmp_path):
    """A running serve (admin token from the environment, upstream key from the file) gets 40
    SIGHUPs while its file is rewritten, in turn, with YAML errors on the secret lines (one of
    them a key serve has never seen) and with a setting that does not validate; it keeps
    serving, counts the failed reloads, and nothing it wrote holds a secret -- not even a
    logged request body that contains one (`log_bodies`)."""
    base = await fake_backend()
    cfg = tmp_path / "c.yaml"
    good = f"baseline: [{base.url}]\npolicy: fixed\nbaseline_api_key: {BASE_KEY}\nlog_bodies: true\n"
    cfg.write_text(good + "reload_settle_s: 0.01\n")
    sp = await spawn_serve("--config", str(cfg), env={"SPECROUTE_ADMIN_TOKEN": TOKEN})
    assert sp.proc.stderr is not None
    stderr = asyncio.ensure_future(sp.proc.stderr.read())
    variants = [
        good + f'admin_token: "{TOKEN}\n',
        f"baseline: [{base.url}]\nbaseline_api_key: {NEW_KEY}: x\n",
        f"baseline: [{base.url}]\neagle_api_key: '{EAGLE_KEY}\n",
        good + "policy_params: {pool: nowhere}\n",
        good + f"eagle: [{TOKEN}]\n",  # echoed by the URL check: a secret from the environment
    ]
    for i in range(40):
        cfg.write_text(variants[i % len(variants)])
        sp.signal(signal.SIGHUP)
        await asyncio.sleep(0.02)

    async def reloads_settled() -> bool:
        samples = await metric_samples(sp.url, "specroute_config_reloads_total")
        return samples.get((("result", "invalid"),), 0) >= 2

    assert await wait_until(reloads_settled, 20.0, interval_s=0.1)
    async with aiohttp.ClientSession() as s:
        body = {"model": "m", "messages": [{"role": "user", "content": f"my token is {TOKEN}"}]}
        async with s.post(sp.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
    assert base.request_headers[-1]["Authorization"] == f"Bearer {BASE_KEY}"  # the key still works
    sp.signal(signal.SIGTERM)
    assert await sp.wait() == 0
    text = (await stderr).decode()
    assert "SIGHUP: reload failed" in text and "not valid YAML" in text and "request /v1/chat" in text
    assert "is not an http(s)" in text
    assert MASK in text  # the logged body, its token masked
    _clean(text)
