"""deploy/: every YAML and JSON file parses; the example config (deploy/specroute.yaml) covers
every setting, loads with the real loader, builds its policies and passes `specroute
check-config` (the admin token masked), as does the Kubernetes ConfigMap's config; a bad value is
named without a traceback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import yaml
from deploy_files import DEPLOY, EXAMPLE, clean_env, configmap_config, example_settings, run_cli, yaml_docs

from controller.proxy.config import Settings, load_settings
from policies.profile import resolve_profile
from policies.registry import PolicyContext, default_registry

# --- every file parses -------------------------------------------------------------------------


def _deploy_files(*suffixes: str) -> Iterator[Path]:
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file() and path.suffix in suffixes:
            yield path


def test_all_yaml_and_json_parse() -> None:
    yamls = list(_deploy_files(".yaml", ".yml"))
    jsons = list(_deploy_files(".json"))
    assert len(yamls) >= 10 and jsons, "deploy/ lost its files"
    for path in yamls:
        assert yaml_docs(path), f"{path} is empty"
    for path in jsons:
        json.loads(path.read_text())


# --- the example config --------------------------------------------------------------------------


def test_example_config_covers_every_setting() -> None:
    keys = set(yaml.safe_load(EXAMPLE.read_text()))
    missing = set(Settings.model_fields) - keys
    assert not missing, f"deploy/specroute.yaml does not show: {sorted(missing)}"


def test_example_config_loads_and_its_policies_build() -> None:
    settings = example_settings()
    assert settings.baseline and settings.eagle
    assert settings.admin_token is None, "the admin token belongs in the environment, not the file"
    registry = default_registry()
    context = PolicyContext(profile=resolve_profile(settings.profile) if settings.profile else None)
    registry.create(settings.policy, settings.policy_params, context)
    assert settings.shadow_policies
    for shadow in settings.shadow_policies:
        registry.create(shadow.name, shadow.params, context)


def test_example_config_passes_check_config_with_the_token_masked() -> None:
    env = clean_env() | {"SPECROUTE_ADMIN_TOKEN": "tok-4f1c9e-not-printed"}
    proc = run_cli("check-config", str(EXAMPLE), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "valid" in proc.stdout
    assert "tok-4f1c9e-not-printed" not in proc.stdout + proc.stderr
    assert "cost_model" in proc.stdout


def test_configmap_config_passes_check_config(tmp_path: Path) -> None:
    path = configmap_config(tmp_path)
    settings = load_settings(environ={}, config_file=path)
    assert settings.host == "0.0.0.0"
    proc = run_cli("check-config", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_config_names_a_bad_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("drain_timeout_s: 30.0", "drain_timeout_s: soon"))
    proc = run_cli("check-config", str(bad))
    assert proc.returncode != 0
    assert "drain_timeout_s" in proc.stderr
    assert "Traceback" not in proc.stderr
