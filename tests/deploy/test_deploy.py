"""deploy/: every file parses, and what it tells specroute, SGLang, systemd, Kubernetes,
Prometheus and Grafana is accepted by the real thing wherever the machine has it:

- the example config and the Kubernetes ConfigMap's config load with the real loader and pass
  `specroute check-config`; the example covers every setting;
- every command line that runs `specroute serve`/`emulate` (Dockerfile, compose, systemd,
  Deployment) parses with the real CLI parser, and its flags appear in `--help`;
- the Kubernetes manifests validate against the Kubernetes JSON schemas (kubernetes-validate,
  offline, strict) and the compose files against the Compose Specification schema
  (check-jsonschema's bundled copy) where those are installed, plus structural checks that
  always run;
- the systemd units pass `systemd-analyze verify` where it exists;
- the Prometheus config passes `promtool check config`; every dashboard query parses as PromQL
  (`promtool check rules`) and names only metrics specroute or SGLang export.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import listening_url
from prometheus_client.parser import text_string_to_metric_families

from controller.cli import build_parser
from controller.proxy.config import Settings, load_settings
from policies.profile import resolve_profile
from policies.registry import PolicyContext, default_registry

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
EXAMPLE = DEPLOY / "specroute.yaml"
K8S = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"

# Flags the eagle SGLang deployment must set (speculative decoding and its running cap).
SPECULATIVE_FLAGS = (
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
    "--max-running-requests",
)
# SGLang launch flags the deploy files may use, checked by hand against SGLang's
# python/sglang/srt/server_args.py (ServerArgs field name -> --kebab-case flag).
SGLANG_FLAGS = frozenset(
    {
        "--model-path",
        "--served-model-name",
        "--host",
        "--port",
        "--tp-size",
        "--enable-metrics",
        "--enable-cache-report",
        "--trust-remote-code",
        *SPECULATIVE_FLAGS,
    }
)

# Public metric names (DESIGN.md "Public surfaces", issue 7) and SGLang's (SGLANG.md).
SPECROUTE_METRICS = frozenset(
    {
        "specroute_requests_total",
        "specroute_in_flight_requests",
        "specroute_decisions_total",
        "specroute_ttft_seconds",
        "specroute_request_duration_seconds",
        "specroute_output_tokens_total",
        "specroute_decode_tokens_per_second",
        "specroute_prediction_ratio",
        "specroute_backend_healthy",
        "specroute_backend_running_requests",
        "specroute_backend_queued_requests",
        "specroute_proxy_overhead_seconds",
        "specroute_shadow_decisions_total",
        "specroute_backend_spec_accept_length",
        "specroute_prefill_tokens_saved_total",
        "specroute_prompt_tokens_total",
        "specroute_prefix_prediction_ratio",
        "specroute_prefix_false_hits_total",
    }
)
# Further metrics the proxy exports (controller/proxy/metrics.py), shown but not part of the list above.
SPECROUTE_EXTRA_METRICS = frozenset(
    {"specroute_rejected_requests_total", "specroute_failovers_total", "specroute_backend_sample_age_seconds"}
)
SGLANG_METRICS = frozenset(
    {
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:token_usage",
        "sglang:spec_accept_length",
        "sglang:spec_accept_rate",
        "sglang:spec_num_steps",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:spec_verify_calls_total",
        "sglang:time_to_first_token_seconds",
        "sglang:inter_token_latency_seconds",
        "sglang:time_per_output_token_seconds",
        "sglang:e2e_request_latency_seconds",
        "sglang:queue_time_seconds",
        "sglang:http_requests_active",
        "sglang:cache_hit_rate",
        "sglang:cached_tokens_total",
        "sglang:num_used_tokens",
        "sglang:max_total_num_tokens",
    }
)


# --- helpers --------------------------------------------------------------------------------


def _clean_env() -> dict[str, str]:
    """This process's environment without SPECROUTE_* (they would override the files)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SPECROUTE_")}


def _specroute(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controller.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env() if env is None else env,
    )


def _subcommands() -> set[str]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action.choices, dict):
            return set(action.choices)
    return set()


def _help_flags(command: str) -> set[str]:
    proc = _specroute(command, "--help")
    assert proc.returncode == 0, proc.stderr
    return set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", proc.stdout))


def _flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def _check_specroute_command(command: str, args: list[str], where: str) -> None:
    """`specroute <command> *args` parses with the real parser and uses only --help's flags."""
    if command not in _subcommands():
        if command == "serve":
            pytest.fail("`specroute serve` does not exist")
        pytest.skip(f"`specroute {command}` is not wired into the CLI yet")
    unknown = set(_flags(args)) - _help_flags(command)
    assert not unknown, f"{where}: `specroute {command} --help` does not list {sorted(unknown)}"
    try:
        build_parser().parse_args([command, *args])
    except SystemExit as e:
        pytest.fail(f"{where}: `specroute {command} {shlex.join(args)}` is rejected by the CLI ({e})")


def _yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _compose(name: str) -> dict[str, Any]:
    data = yaml.safe_load((DEPLOY / name).read_text())
    assert isinstance(data, dict)
    return data


_DEFAULT = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


def _compose_value(value: str) -> str:
    """Compose interpolation with the defaults the file gives (${X:-default} -> default)."""
    return _DEFAULT.sub(lambda m: m.group(2) or "", value)


def _arg_value(args: list[str], flag: str) -> str:
    i = args.index(flag)
    return args[i + 1]


def _example_settings() -> Settings:
    return load_settings(environ={}, config_file=EXAMPLE)


def _configmap_config(tmp_path: Path) -> Path:
    (cm,) = _yaml_docs(K8S / "configmap.yaml")
    path = tmp_path / "specroute.yaml"
    path.write_text(cm["data"]["specroute.yaml"])
    return path


def _deployment() -> dict[str, Any]:
    (dep,) = _yaml_docs(K8S / "deployment.yaml")
    assert isinstance(dep, dict)
    return dep


# systemd unit files: sections of `Key=value` lines, `\` continues a line, keys may repeat.
def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a Key=value line: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _env_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=value: {line!r}"
        out[key.strip()] = value.strip()
    return out


def _exec_start(unit: dict[str, dict[str, list[str]]], env: dict[str, str]) -> list[str]:
    """ExecStart with systemd's substitution: ${X} is one word, $X splits at whitespace."""
    (line,) = unit["Service"]["ExecStart"]
    words: list[str] = []
    for word in shlex.split(line):
        m = re.fullmatch(r"\$([A-Z_][A-Z0-9_]*)", word)
        if m:
            words.extend(env.get(m.group(1), "").split())
            continue
        words.append(re.sub(r"\$\{([A-Z_][A-Z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word))
    return words


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|min|m)?", value.strip())
    assert m, f"cannot read a duration from {value!r}"
    return float(m.group(1)) * (60 if m.group(2) in ("min", "m") else 1)


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
        assert _yaml_docs(path), f"{path} is empty"
    for path in jsons:
        json.loads(path.read_text())


# --- the example config --------------------------------------------------------------------------


def test_example_config_covers_every_setting() -> None:
    keys = set(yaml.safe_load(EXAMPLE.read_text()))
    missing = set(Settings.model_fields) - keys
    assert not missing, f"deploy/specroute.yaml does not show: {sorted(missing)}"


def test_example_config_loads_and_its_policies_build() -> None:
    settings = _example_settings()
    assert settings.baseline and settings.eagle
    assert settings.admin_token is None, "the admin token belongs in the environment, not the file"
    registry = default_registry()
    context = PolicyContext(profile=resolve_profile(settings.profile) if settings.profile else None)
    registry.create(settings.policy, settings.policy_params, context)
    assert settings.shadow_policies
    for shadow in settings.shadow_policies:
        registry.create(shadow.name, shadow.params, context)


def test_example_config_passes_check_config_with_the_token_masked() -> None:
    env = _clean_env() | {"SPECROUTE_ADMIN_TOKEN": "tok-4f1c9e-not-printed"}
    proc = _specroute("check-config", str(EXAMPLE), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "valid" in proc.stdout
    assert "tok-4f1c9e-not-printed" not in proc.stdout + proc.stderr
    assert "cost_model" in proc.stdout


def test_configmap_config_passes_check_config(tmp_path: Path) -> None:
    path = _configmap_config(tmp_path)
    settings = load_settings(environ={}, config_file=path)
    assert settings.host == "0.0.0.0"
    proc = _specroute("check-config", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_config_names_a_bad_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("drain_timeout_s: 30.0", "drain_timeout_s: soon"))
    proc = _specroute("check-config", str(bad))
    assert proc.returncode != 0
    assert "drain_timeout_s" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- command lines ---------------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        out.append((instruction.upper(), rest.strip()))
    return out


def _final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (ins, _) in enumerate(instructions) if ins == "FROM"]
    return instructions[starts[-1] :]


def test_dockerfile_structure() -> None:
    final = _final_stage(_dockerfile())
    assert re.fullmatch(r"python:3\.1[1-9][\w.]*-slim(\S*)?", final[0][1].split()[0]), final[0]
    users = [rest for ins, rest in final if ins == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must run as non-root"
    (healthcheck,) = [rest for ins, rest in final if ins == "HEALTHCHECK"]
    assert "/health" in healthcheck
    for ins, rest in final:
        if ins == "COPY" and not rest.startswith("--from"):
            src = rest.split()[0]
            assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"
    ignored = {
        line.strip().rstrip("/")
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    needed = {
        "pyproject.toml", "constraints.txt", "controller", "policies", "simulator", "deploy",
        "deploy/specroute.yaml",
    }  # fmt: skip
    assert not ignored & needed, f"Dockerfile.dockerignore hides {ignored & needed}"


def _healthcheck_command() -> list[str]:
    (healthcheck,) = [rest for ins, rest in _final_stage(_dockerfile()) if ins == "HEALTHCHECK"]
    _, sep, exec_form = healthcheck.partition(" CMD ")
    assert sep, "HEALTHCHECK needs a CMD"
    command = json.loads(exec_form)
    assert isinstance(command, list)
    return [str(w) for w in command]


def test_dockerfile_runs_specroute_serve_with_accepted_flags() -> None:
    final = _final_stage(_dockerfile())
    (entrypoint,) = [json.loads(rest) for ins, rest in final if ins == "ENTRYPOINT"]
    (cmd,) = [json.loads(rest) for ins, rest in final if ins == "CMD"]
    assert entrypoint == ["specroute", "serve"]
    _check_specroute_command("serve", cmd, "Dockerfile CMD")
    port = _arg_value(cmd, "--port")
    exposed = [rest for ins, rest in final if ins == "EXPOSE"]
    assert exposed == [port]
    (healthcheck,) = [rest for ins, rest in final if ins == "HEALTHCHECK"]
    assert f"127.0.0.1:{port}/health" in healthcheck
    assert _arg_value(cmd, "--config") == "/etc/specroute/specroute.yaml"


def test_systemd_specroute_command_is_accepted() -> None:
    unit = _unit(SYSTEMD / "specroute.service")
    env = _env_file(SYSTEMD / "specroute.env")
    words = _exec_start(unit, env)
    assert words[0].endswith("/specroute") and words[1] == "serve", words
    _check_specroute_command("serve", words[2:], "specroute.service ExecStart")


def test_kubernetes_command_is_accepted() -> None:
    (container,) = _deployment()["spec"]["template"]["spec"]["containers"]
    assert "command" not in container, "the image's entrypoint (specroute serve) is expected"
    _check_specroute_command("serve", container["args"], "deployment.yaml args")


@pytest.mark.parametrize("compose_file", ["compose.yaml", "compose.emulated.yaml"])
def test_compose_specroute_commands_are_accepted(compose_file: str) -> None:
    services = _compose(compose_file)["services"]
    for name, service in services.items():
        entrypoint = service.get("entrypoint")
        command = service.get("command")
        if name == "specroute":
            assert entrypoint is None, "specroute runs the image's entrypoint"
            if command is not None:
                _check_specroute_command("serve", [_compose_value(c) for c in command], compose_file)
        elif entrypoint is not None and entrypoint[0] == "specroute":
            args = [*entrypoint[1:], *command]
            _check_specroute_command(args[0], [_compose_value(a) for a in args[1:]], f"{compose_file} {name}")


# --- compose ------------------------------------------------------------------------------------


EXPECTED_SERVICES = {"sglang-baseline", "sglang-eagle", "specroute", "prometheus", "grafana"}


def _local_sources(service: dict[str, Any]) -> Iterator[str]:
    for volume in service.get("volumes", []):
        source = volume.split(":")[0]
        if source.startswith("."):
            yield source


@pytest.mark.parametrize("compose_file", ["compose.yaml", "compose.emulated.yaml"])
def test_compose_structure(compose_file: str) -> None:
    compose = _compose(compose_file)
    services = compose["services"]
    assert set(services) == EXPECTED_SERVICES
    for name, service in services.items():
        for source in _local_sources(service):
            assert (DEPLOY / source).exists(), f"{compose_file} {name} mounts {source}: missing"
        build = service.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    mounts = {m for s in services.values() for m in s.get("volumes", [])}
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts
    assert "./grafana/specroute.json:/var/lib/grafana/dashboards/specroute.json:ro" in mounts
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in mounts
    specroute = services["specroute"]
    example = _example_settings()
    assert _seconds(specroute["stop_grace_period"]) > example.shutdown_grace_s + example.drain_timeout_s
    env = specroute["environment"]
    for pool in ("baseline", "eagle"):
        url = env[f"SPECROUTE_{pool.upper()}"]
        host, port = url.removeprefix("http://").split(":")
        assert host == f"sglang-{pool}"
        command = [_compose_value(c) for c in services[host]["command"]]
        assert _arg_value(command, "--port") == port
        assert _arg_value(command, "--host") == "0.0.0.0"
    named = set(compose.get("volumes") or {})
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/", "~", "$")):
                assert source in named, f"named volume {source} is not declared"


def test_compose_files_validate_against_the_compose_spec() -> None:
    pytest.importorskip("check_jsonschema", reason="check-jsonschema is not installed")
    files = [str(DEPLOY / "compose.yaml"), str(DEPLOY / "compose.emulated.yaml")]
    proc = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", *files],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_sglang_servers_use_real_flags_and_gpus() -> None:
    services = _compose("compose.yaml")["services"]
    for pool in ("baseline", "eagle"):
        service = services[f"sglang-{pool}"]
        command = [_compose_value(c) for c in service["command"]]
        assert command[:3] == ["python3", "-m", "sglang.launch_server"]
        flags = _flags(command[3:])
        assert set(flags) <= SGLANG_FLAGS, set(flags) - SGLANG_FLAGS
        assert "--enable-metrics" in flags
        assert all(c != "" for c in command), "a ${VAR} without default would be empty"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        if pool == "eagle":
            for flag in SPECULATIVE_FLAGS:
                assert flag in flags
            _check_draft_tokens(command)
        else:
            assert not [f for f in flags if f.startswith("--speculative")]
    base = [_compose_value(c) for c in services["sglang-baseline"]["command"]]
    eagle = [_compose_value(c) for c in services["sglang-eagle"]["command"]]
    for flag in ("--model-path", "--served-model-name"):
        assert _arg_value(base, flag) == _arg_value(eagle, flag), f"both pools must share {flag}"


def _check_draft_tokens(command: list[str]) -> None:
    assert _arg_value(command, "--speculative-algorithm") == "EAGLE3"
    if _arg_value(command, "--speculative-eagle-topk") == "1":
        steps = int(_arg_value(command, "--speculative-num-steps"))
        assert int(_arg_value(command, "--speculative-num-draft-tokens")) == steps + 1


# --- systemd ------------------------------------------------------------------------------------


def test_systemd_sglang_units_use_real_flags() -> None:
    commands = {}
    for pool in ("baseline", "eagle"):
        unit = _unit(SYSTEMD / f"sglang-{pool}.service")
        env = _env_file(SYSTEMD / f"sglang-{pool}.env")
        (line,) = unit["Service"]["ExecStart"]
        for var in re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", line):
            assert var in env, f"sglang-{pool}.service uses ${var}, not set in sglang-{pool}.env"
        (env_file,) = unit["Service"]["EnvironmentFile"]
        assert env_file == f"/etc/specroute/sglang-{pool}.env"
        words = _exec_start(unit, env)
        assert words[1:3] == ["-m", "sglang.launch_server"], words
        flags = _flags(words[3:])
        assert set(flags) <= SGLANG_FLAGS, set(flags) - SGLANG_FLAGS
        assert "--enable-metrics" in flags
        assert "" not in words
        if pool == "eagle":
            for flag in SPECULATIVE_FLAGS:
                assert flag in flags
            _check_draft_tokens(words)
        commands[pool] = words
    for flag in ("--model-path", "--served-model-name"):
        assert _arg_value(commands["baseline"], flag) == _arg_value(commands["eagle"], flag)
    # the example config points at the ports the units listen on
    settings = _example_settings()
    for pool in ("baseline", "eagle"):
        urls = [b.url for b in settings.backends(pool)]  # type: ignore[arg-type]
        assert urls == [f"http://127.0.0.1:{_arg_value(commands[pool], '--port')}"]


def test_systemd_units_structure() -> None:
    example = _example_settings()
    drain = example.shutdown_grace_s + example.drain_timeout_s
    for path in sorted(SYSTEMD.glob("*.service")):
        unit = _unit(path)
        assert {"Unit", "Service", "Install"} <= set(unit), path.name
        service = unit["Service"]
        assert service["Restart"] == ["on-failure"], path.name
        assert service.get("EnvironmentFile"), path.name
        assert "network-online.target" in " ".join(unit["Unit"]["After"]), path.name
        assert unit["Install"]["WantedBy"] == ["multi-user.target"]
        assert (SYSTEMD / Path(service["EnvironmentFile"][0]).name).is_file(), "env file not shipped"
    specroute = _unit(SYSTEMD / "specroute.service")
    for key in ("After", "Wants"):
        names = " ".join(specroute["Unit"][key]).split()
        assert {"sglang-baseline.service", "sglang-eagle.service"} <= set(names), key
    (stop,) = specroute["Service"]["TimeoutStopSec"]
    assert _seconds(stop) > drain, "systemd would SIGKILL specroute before its drain ends"
    assert specroute["Service"]["KillSignal"] == ["SIGTERM"]
    # `systemctl reload` re-reads the config: SIGHUP to the main process (serve's reload signal)
    (reload,) = specroute["Service"]["ExecReload"]
    assert re.fullmatch(r"(/usr)?/bin/kill -(HUP|s HUP|SIGHUP) \$MAINPID", reload), reload


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify insists that ExecStart's binary exists: point the install paths at real ones.
    specroute_bin = shutil.which("specroute") or sys.executable
    for path in SYSTEMD.glob("*.service"):
        text = path.read_text()
        text = text.replace("/opt/sglang/venv/bin/python", sys.executable)
        text = text.replace("/opt/specroute/venv/bin/specroute", specroute_bin)
        (tmp_path / path.name).write_text(text)
    units = sorted(str(p) for p in tmp_path.glob("*.service"))
    assert len(units) == 3
    proc = subprocess.run(
        ["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    if proc.returncode != 0 and "Failed to" in proc.stderr and "bus" in proc.stderr.lower():
        pytest.skip(f"systemd-analyze cannot run here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr


# --- Kubernetes ----------------------------------------------------------------------------------


def _manifests() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in _yaml_docs(path):
            yield path.name, doc


def test_kubernetes_manifests_validate_against_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    checked = []
    for name, doc in _manifests():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema in the Kubernetes set; see the structural test
        try:
            kv.validate(doc, "1.30", strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{name} {doc['kind']}: {e}")
        checked.append(doc["kind"])
    assert sorted(checked) == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service"]


def test_kubernetes_structure(tmp_path: Path) -> None:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for _, doc in _manifests():
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"]["name"]
        kinds.setdefault(doc["kind"], []).append(doc)
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
    assert {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"} == set(kustomization["resources"])

    dep = _deployment()
    assert dep["apiVersion"] == "apps/v1"
    pod = dep["spec"]["template"]["spec"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    assert pod["securityContext"]["runAsNonRoot"] is True

    settings = load_settings(environ={}, config_file=_configmap_config(tmp_path))
    assert settings.port in ports.values()
    assert settings.replicas == dep["spec"]["replicas"]  # each replica is told how many there are
    # SIGTERM comes after preStop (none: specroute's shutdown_grace_s covers the endpoint update)
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pause = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    assert settings.shutdown_grace_s >= 5  # kube-proxy and ingresses take seconds to drop the pod
    grace = settings.shutdown_grace_s + settings.drain_timeout_s
    assert pod["terminationGracePeriodSeconds"] > pause + grace + 2  # exit takes ~1 s after the drain
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (config_volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert config_volume["configMap"]["name"] == kinds["ConfigMap"][0]["metadata"]["name"]
    assert _arg_value(container["args"], "--config").startswith(mounts[config_volume["name"]] + "/")
    assert settings.decision_log is not None
    assert Path(settings.decision_log).parent == Path(mounts["logs"])

    (service,) = kinds["Service"]
    assert service["spec"]["selector"].items() <= labels.items()
    (sport,) = service["spec"]["ports"]
    assert sport["targetPort"] in ports

    monitors = {m["metadata"]["name"]: m for m in kinds["ServiceMonitor"]}
    own = monitors["specroute"]
    assert own["apiVersion"] == "monitoring.coreos.com/v1"
    assert own["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in own["spec"]["endpoints"]] == [sport["name"]]
    assert all(e["path"] == "/metrics" for m in monitors.values() for e in m["spec"]["endpoints"])


# --- Prometheus and Grafana ----------------------------------------------------------------------


def test_prometheus_config_targets_the_compose_services() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"specroute", "sglang"}
    compose = _compose("compose.yaml")["services"]
    targets = {
        t: group.get("labels", {})
        for job in jobs.values()
        for group in job["static_configs"]
        for t in group["targets"]
    }
    for target, labels in targets.items():
        host = target.split(":")[0]
        assert host in compose, f"prometheus target {target} is not a compose service"
        if host.startswith("sglang-"):
            assert labels == {"pool": host.removeprefix("sglang-")}
    assert "specroute:8000" in targets


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_checks_prometheus_config() -> None:
    proc = subprocess.run(
        ["promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _dashboard() -> dict[str, Any]:
    data = json.loads((DEPLOY / "grafana" / "specroute.json").read_text())
    assert isinstance(data, dict)
    return data


def _queries() -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in _dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


_METRIC = re.compile(r"\b(specroute_[a-z0-9_]+|sglang:[a-z0-9_:]+)")


def _base_name(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_dashboard_uses_known_metrics_and_covers_them() -> None:
    used = {_base_name(m) for _, expr in _queries() for m in _METRIC.findall(expr)}
    unknown = used - SPECROUTE_METRICS - SPECROUTE_EXTRA_METRICS - SGLANG_METRICS
    assert not unknown, f"dashboard queries metrics nobody exports: {sorted(unknown)}"
    missing = SPECROUTE_METRICS - used
    assert not missing, f"dashboard shows no panel for {sorted(missing)}"
    for sglang in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:spec_accept_length"):
        assert sglang in used


def test_dashboard_structure() -> None:
    dash = _dashboard()
    assert dash["uid"] == "specroute"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {panel['title']!r} overlaps another"
                cells.add((x, y))
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
            for var in re.findall(r"\$(\w+)", target["expr"]):
                assert var == "__rate_interval" or var in variables, f"unknown variable ${var}"
    provisioning = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )
    assert provisioning["datasources"][0]["url"] == "http://prometheus:9090"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    rules = []
    for i, (title, expr) in enumerate(_queries()):
        concrete = expr.replace("$__rate_interval", "1m")
        concrete = re.sub(r"\$\w+", ".*", concrete)
        rules.append({"record": f"dashboard:query_{i}", "expr": concrete, "labels": {"panel": title}})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


# --- the emulated stack, run as compose.emulated.yaml runs it (without Docker) ----------------------


def _start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """Start `specroute ARGS` and return it with the URL it prints when listening."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = listening_url(proc, 60)
    if url is not None:
        return proc, url
    proc.kill()
    _, err = proc.communicate(timeout=10)
    pytest.fail(f"`specroute {shlex.join(args)}` did not start: {err[-2000:]}")


def _local(args: list[str]) -> list[str]:
    """A container command line made fit for a test: loopback and a free port."""
    out = list(args)
    out[out.index("--host") + 1] = "127.0.0.1"
    out[out.index("--port") + 1] = "0"
    return out


def _exported_metric_names(text: str) -> set[str]:
    """Metric names as PromQL sees them (counters with _total, histograms by base name)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail("specroute never became ready")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def test_emulated_stack_serves_through_the_deploy_command_lines(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    services = _compose("compose.emulated.yaml")["services"]
    final = _final_stage(_dockerfile())
    (cmd,) = [json.loads(rest) for ins, rest in final if ins == "CMD"]
    env = _clean_env()
    started: list[subprocess.Popen[str]] = []
    try:
        urls = {}
        for pool in ("baseline", "eagle"):
            service = services[f"sglang-{pool}"]
            args = [*service["entrypoint"][1:], *_local(service["command"])]
            proc, urls[pool] = _start(args, env)
            started.append(proc)
        serve_env = env | {k: _compose_value(str(v)) for k, v in services["specroute"]["environment"].items()}
        serve_env |= {
            "SPECROUTE_BASELINE": urls["baseline"],
            "SPECROUTE_EAGLE": urls["eagle"],
            "SPECROUTE_DECISION_LOG": str(tmp_path / "decisions.jsonl"),
        }
        args = _local(cmd)
        args[args.index("--config") + 1] = str(EXAMPLE)
        serve, url = _start(["serve", *args], serve_env)
        started.append(serve)
        _wait_ready(url)

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Say hello."}]
        raw = client.chat.completions.with_raw_response.create(model="any", messages=messages, max_tokens=8)
        assert raw.headers["x-specroute-pool"] in ("baseline", "eagle")
        assert raw.parse().usage.completion_tokens == 8
        stream = client.chat.completions.create(model="any", messages=messages, max_tokens=8, stream=True)
        assert any(chunk.choices and chunk.choices[0].delta.content for chunk in stream)
        # the image's HEALTHCHECK command, pointed at this port, reports healthy
        probe = [w.replace("127.0.0.1:8000", url.removeprefix("http://")) for w in _healthcheck_command()]
        assert probe[0] == "python"
        assert subprocess.run([sys.executable, *probe[1:]], timeout=30).returncode == 0
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            exported = _exported_metric_names(r.read().decode())
        on_dashboard = {
            _base_name(m)
            for _, expr in _queries()
            for m in _METRIC.findall(expr)
            if m.startswith("specroute_")
        }
        missing = on_dashboard - exported
        assert not missing, f"the dashboard queries metrics specroute does not export: {sorted(missing)}"

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=40) == 0
        lines = (tmp_path / "decisions.jsonl").read_text().splitlines()
        assert len(lines) == 2
        assert all(json.loads(line)["policy"] == "cost_model" for line in lines)
    finally:
        for proc in reversed(started):
            _stop(proc)


# --- the image's package: what `docker build` installs (without Docker) -----------------------------


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Docker's .dockerignore glob: `*` and `?` stay within one path element, `**` spans any."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out, i = out + {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i])), i + 1
    return re.compile(out)


def _dockerignored() -> Callable[[str], bool]:
    """Is this context-relative path excluded by deploy/Dockerfile.dockerignore? A pattern that
    matches a directory excludes what is under it; a later `!pattern` line re-includes."""
    rules = []
    for raw in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), _glob_regex(line.removeprefix("!").strip("/"))))

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        result = False
        for negate, regex in rules:
            if any(regex.fullmatch(prefix) for prefix in prefixes):
                result = not negate
        return result

    return ignored


def test_dockerignore_matching_follows_docker_rules() -> None:
    ignored = _dockerignored()
    assert ignored("tests/test_deploy.py") and ignored("controller/__pycache__/app.cpython-311.pyc")
    assert ignored("specroute.egg-info/PKG-INFO") and ignored(".git/HEAD") and ignored("__pycache__/x.pyc")
    assert not ignored("controller/app.py") and not ignored("deploy/specroute.yaml")
    assert not ignored("pyproject.toml") and not ignored("README.md")


def test_image_package_holds_every_module_and_data_file(tmp_path: Path) -> None:
    """Build the package from the files `docker build` sends (git's files minus the
    .dockerignore) the way the image's `pip wheel` does (setuptools build_py: the wheel's
    contents for a pure-Python package), then run the image's commands from that build, outside
    the checkout: every module and data file (built-in profiles, bench prompts) is in it, and
    the copied config passes check-config with every profile the deploy files name."""
    pytest.importorskip("setuptools", reason="setuptools is not installed")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout.split("\0")
    ignored = _dockerignored()
    context = tmp_path / "context"
    for rel in filter(None, listed):
        if ignored(rel) or not (ROOT / rel).is_file():
            continue
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)
    lib = tmp_path / "lib"
    build = subprocess.run(
        [
            sys.executable,
            "-c",
            "import setuptools; setuptools.setup()",
            "-q",
            "build_py",
            "--build-lib",
            str(lib),
        ],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
    )
    assert build.returncode == 0, build.stderr[-3000:]

    packages = ("controller", "policies", "simulator")
    shipped = {rel for rel in listed if rel.split("/")[0] in packages}
    built = {str(f.relative_to(lib)) for f in lib.rglob("*") if f.is_file() and "__pycache__" not in f.parts}
    assert shipped - built == set(), "the image would lack these files"
    assert any(rel.endswith(".json") for rel in built) and any(rel.endswith(".jsonl") for rel in built)

    env = _clean_env() | {"PYTHONPATH": str(lib)}
    where = subprocess.run(
        [sys.executable, "-c", "import controller, policies, simulator as s; print(s.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert where.returncode == 0 and where.stdout.startswith(str(lib)), where.stdout + where.stderr

    def run(*args: str, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "controller.cli", *args],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env | (extra or {}),
        )  # fmt: skip

    (config_copy,) = [
        rest.split()
        for ins, rest in _final_stage(_dockerfile())
        if ins == "COPY" and "specroute.yaml" in rest
    ]
    config = context / config_copy[0]
    profiles = {"kimi-k25-int4-8gpu"}
    for name in ("compose.yaml", "compose.emulated.yaml"):
        services = _compose(name)["services"]
        profiles.add(_compose_value(str(services["specroute"]["environment"]["SPECROUTE_PROFILE"])))
        for service in services.values():
            args = [_compose_value(str(a)) for a in service.get("command") or []]
            if "--profile" in args and service.get("entrypoint", [""])[0] == "specroute":
                profiles.add(_arg_value(args, "--profile"))
    assert len(profiles) >= 2
    for profile in sorted(profiles):
        proc = run("check-config", str(config), extra={"SPECROUTE_PROFILE": profile})
        assert proc.returncode == 0, f"profile {profile}: {proc.stdout[-500:]}{proc.stderr[-2000:]}"
    for command in ("serve", "emulate", "bench"):
        proc = run(command, "--help")
        assert proc.returncode == 0, proc.stderr[-2000:]
