"""Settings: precedence CLI > env > file > defaults, errors naming key and source, check-config,
and the `policies` listing."""

from __future__ import annotations

import os

import pytest

from controller.cli import main
from controller.proxy.config import ConfigError, Settings, load_settings


def _write(tmp_path, text: str):
    path = tmp_path / "specroute.yaml"
    path.write_text(text)
    return path


def test_defaults():
    s = load_settings({}, {}, None)
    assert (s.host, s.port, s.policy, s.allow_client_override) == ("127.0.0.1", 8000, "online", False)
    assert s.spec_details is False
    assert s.body_limit_bytes == 32 * 1024 * 1024
    assert s.health_check_path == "/ready"
    assert s.admin_token is None and s.decision_log is None and s.shadow_policies == []


def test_default_policy_is_cost_model_with_a_profile_else_online(tmp_path):
    # without a profile nothing can predict a pool's speed: online learns it from outcomes
    assert load_settings({"profile": "  "}, {}, None).policy == "online"
    f = _write(tmp_path, "profile: kimi-k25-int4-8gpu\n")
    assert load_settings({}, {}, f).policy == "cost_model"
    assert load_settings({}, {"SPECROUTE_PROFILE": "kimi-k25-int4-8gpu"}, None).policy == "cost_model"
    assert load_settings({"policy": "threshold"}, {}, f).policy == "threshold"  # given beats default
    # parameters given for the default policy stay with it
    f = _write(tmp_path, "profile: kimi-k25-int4-8gpu\npolicy_params: {objective: ttft}\n")
    s = load_settings({"policy": "cost_model"}, {}, f)
    assert s.policy == "cost_model" and s.policy_params == {"objective": "ttft"}
    s = load_settings({"policy": "fixed"}, {}, f)
    assert s.policy == "fixed" and s.policy_params == {}


def test_precedence_cli_over_env_over_file(tmp_path):
    f = _write(
        tmp_path,
        "baseline: [http://file-b:1]\neagle: http://file-e:1, http://file-e:2\nport: 7000\n"
        "host: 0.0.0.0\nidle_timeout_s: 9\nseed: 3\n",
    )
    env = {
        "SPECROUTE_PORT": "7100",
        "SPECROUTE_IDLE_TIMEOUT_S": "8",
        "SPECROUTE_UNRELATED": "x",
        "PATH": "/bin",
    }
    s = load_settings({"port": "7200", "baseline": "http://cli-b:1/"}, env, f)
    assert s.port == 7200  # cli
    assert s.idle_timeout_s == 8.0  # env
    assert s.host == "0.0.0.0" and s.seed == 3  # file
    assert [b.entry for b in s.baseline] == ["http://cli-b:1"]  # trailing slash normalised
    assert [b.entry for b in s.eagle] == ["http://file-e:1", "http://file-e:2"]  # comma-separated in the file
    assert s.connect_timeout_s == Settings.model_fields["connect_timeout_s"].default


def test_policy_params_merge_and_do_not_leak_across_policies(tmp_path):
    f = _write(tmp_path, "policy: threshold\npolicy_params: {threshold: 4, hysteresis: 1}\n")
    s = load_settings({"policy_params": {"threshold": 6}}, {}, f)
    assert s.policy_params == {"threshold": 6, "hysteresis": 1}
    s = load_settings({"policy": "fixed", "policy_params": {"pool": "eagle"}}, {}, f)
    assert s.policy == "fixed" and s.policy_params == {"pool": "eagle"}
    s = load_settings({}, {"SPECROUTE_POLICY_PARAMS": '{"threshold": 2}'}, f)
    assert s.policy_params == {"threshold": 2, "hysteresis": 1}


def test_secrets_are_masked_and_never_in_repr():
    s = load_settings({}, {"SPECROUTE_ADMIN_TOKEN": "tok-123", "SPECROUTE_EAGLE_API_KEY": "key-456"}, None)
    assert s.admin_token is not None and s.admin_token.get_secret_value() == "tok-123"
    dumped = s.masked()
    assert dumped["admin_token"] == "**********" and dumped["eagle_api_key"] == "**********"
    assert "tok-123" not in repr(s) and "key-456" not in str(dumped)


@pytest.mark.parametrize(
    ("cli", "env", "file_text", "needle"),
    [
        ({"port": "70000"}, {}, None, "port (from flag --port)"),
        (
            {},
            {"SPECROUTE_CONNECT_TIMEOUT_S": "0"},
            None,
            "connect_timeout_s (from environment SPECROUTE_CONNECT",
        ),
        ({}, {}, "first_byte_timeout_s: soon\n", "first_byte_timeout_s (from config file"),
        ({}, {}, "bogus_key: 1\n", "unknown key(s) bogus_key"),
        ({}, {}, "port: [1\n", "not valid YAML"),
        ({}, {}, "- a\n- b\n", "expected a mapping"),
        ({"baseline": "http://a:1", "eagle": "http://a:1"}, {}, None, "listed twice"),
        ({"baseline": "a:1"}, {}, None, "baseline (from flag --baseline)"),
        ({"eagle": "http://gpu:30000/v1"}, {}, None, "without a path"),
        (
            {},
            {},
            "baseline: [http://baseline-1.invalid:30000]\n",
            "'http://baseline-1.invalid:30000' is a placeholder",
        ),
        (
            {"eagle": "e=http://EAGLE-0.Invalid."},
            {},
            None,
            "eagle (from flag --eagle): 'http://EAGLE-0.Invalid.' is a",
        ),
        ({}, {}, "health_check_path: health\n", "health_check_path"),
        ({}, {"SPECROUTE_SHADOW_POLICIES": "[{"}, None, "not valid JSON"),
        ({}, {"SPECROUTE_SHADOW_POLICIES": '[{"nme": "fixed"}]'}, None, "shadow_policies.0"),
    ],
)
def test_invalid_values_name_key_and_source(tmp_path, cli, env, file_text, needle):
    f = _write(tmp_path, file_text) if file_text is not None else None
    with pytest.raises(ConfigError) as info:
        load_settings(cli, env, f)
    assert needle in str(info.value)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings({}, {}, tmp_path / "absent.yaml")


def test_check_config_prints_resolved_settings_with_secrets_masked(tmp_path, capsys, monkeypatch):
    for k in [k for k in os.environ if k.startswith("SPECROUTE_")]:
        monkeypatch.delenv(k)  # the environment, not our code: check-config applies SPECROUTE_*
    f = _write(
        tmp_path,
        "baseline: [http://10.0.0.1:30000]\neagle: [http://10.0.0.2:30000]\npolicy: threshold\n"
        "policy_params: {threshold: 12}\nadmin_token: very-secret\nbaseline_api_key: sk-hidden\n",
    )
    assert main(["check-config", str(f)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "threshold: 12" in out and "http://10.0.0.2:30000" in out
    assert "very-secret" not in out and "sk-hidden" not in out
    assert "admin_token: '**********'" in out


def test_check_config_rejects_bad_file_with_exit_2(tmp_path, capsys):
    f = _write(tmp_path, "baseline: [http://x:1]\npolicy: threshold\npolicy_params: {threshold: -1}\n")
    assert main(["check-config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specroute check-config: error: ") and "threshold" in err
    f = _write(tmp_path, "port: 1\n")
    assert main(["check-config", str(f)]) == 2
    assert "no backend configured" in capsys.readouterr().err


def test_policies_command_lists_policies_and_parameters(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "fixed" in out and "threshold" in out
    assert "--policy-param pool=" in out and "--policy-param threshold=" in out


def test_shadow_policies_accept_the_inline_grammar_everywhere(tmp_path, capsys):
    """`NAME:KEY=VALUE,...` works in the YAML file and the environment as on the command line,
    mixed with the mapping form; a bad entry names the key and the entry, not pydantic's types."""
    f = _write(
        tmp_path,
        "baseline: [http://10.0.0.1:30000]\nprofile: kimi-k25-int4-8gpu\nshadow_policies:\n"
        "  - threshold:threshold=8\n"
        "  - 'cost_model:objective=ttft,hint_speedup={\"code\":1.2}'\n"
        "  - {name: fixed, params: {pool: eagle}, label: all-eagle}\n",
    )
    s = load_settings({}, {}, f)
    assert [(x.name, x.params, x.label) for x in s.shadow_policies] == [
        ("threshold", {"threshold": 8}, None),
        ("cost_model", {"objective": "ttft", "hint_speedup": {"code": 1.2}}, None),
        ("fixed", {"pool": "eagle"}, "all-eagle"),
    ]
    s = load_settings({}, {"SPECROUTE_SHADOW_POLICIES": '["round_robin", "threshold:threshold=4"]'}, None)
    assert [(x.name, x.params) for x in s.shadow_policies] == [
        ("round_robin", {}),
        ("threshold", {"threshold": 4}),
    ]
    assert main(["check-config", str(f)]) == 0  # the policies build
    capsys.readouterr()
    bad = _write(tmp_path, "baseline: [http://x:1]\nshadow_policies: ['threshold:threshold=8,oops']\n")
    with pytest.raises(ConfigError) as info:
        load_settings({}, {}, bad)
    assert "shadow_policies" in str(info.value) and "expected KEY=VALUE" in str(info.value)
