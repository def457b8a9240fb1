"""deploy/compose*.yaml: the services, mounts and volumes are consistent, the files validate
against the Compose Specification (check-jsonschema's bundled copy, where installed), the SGLang
servers use real SGLang flags and GPUs and the image of the SGLang release the emulator speaks,
the profile specroute runs with has what its policy parameters read, and every `specroute`
command line parses with the real CLI parser and uses only flags its `--help` lists."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from deploy_files import (
    DEPLOY,
    SGLANG_FLAGS,
    SPECULATIVE_FLAGS,
    arg_value,
    check_draft_tokens,
    check_specroute_command,
    compose_value,
    duration_s,
    example_settings,
    flag_names,
    load_compose,
)

EXPECTED_SERVICES = {"sglang-baseline", "sglang-eagle", "specroute", "prometheus", "grafana"}


def _local_sources(service: dict[str, Any]) -> Iterator[str]:
    for volume in service.get("volumes", []):
        source = volume.split(":")[0]
        if source.startswith("."):
            yield source


@pytest.mark.parametrize("compose_file", ["compose.yaml", "compose.emulated.yaml"])
def test_compose_structure(compose_file: str) -> None:
    compose = load_compose(compose_file)
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
    example = example_settings()
    assert duration_s(specroute["stop_grace_period"]) > example.shutdown_grace_s + example.drain_timeout_s
    env = specroute["environment"]
    for pool in ("baseline", "eagle"):
        url = env[f"SPECROUTE_{pool.upper()}"]
        host, port = url.removeprefix("http://").split(":")
        assert host == f"sglang-{pool}"
        command = [compose_value(c) for c in services[host]["command"]]
        assert arg_value(command, "--port") == port
        assert arg_value(command, "--host") == "0.0.0.0"
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
    services = load_compose("compose.yaml")["services"]
    for pool in ("baseline", "eagle"):
        service = services[f"sglang-{pool}"]
        command = [compose_value(c) for c in service["command"]]
        assert command[:3] == ["python3", "-m", "sglang.launch_server"]
        flags = flag_names(command[3:])
        assert set(flags) <= SGLANG_FLAGS, set(flags) - SGLANG_FLAGS
        assert "--enable-metrics" in flags
        assert all(c != "" for c in command), "a ${VAR} without default would be empty"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        if pool == "eagle":
            for flag in SPECULATIVE_FLAGS:
                assert flag in flags
            check_draft_tokens(command)
        else:
            assert not [f for f in flags if f.startswith("--speculative")]
    base = [compose_value(c) for c in services["sglang-baseline"]["command"]]
    eagle = [compose_value(c) for c in services["sglang-eagle"]["command"]]
    for flag in ("--model-path", "--served-model-name"):
        assert arg_value(base, flag) == arg_value(eagle, flag), f"both pools must share {flag}"


@pytest.mark.parametrize("compose_file", ["compose.yaml", "compose.emulated.yaml"])
def test_compose_specroute_commands_are_accepted(compose_file: str) -> None:
    services = load_compose(compose_file)["services"]
    for name, service in services.items():
        entrypoint = service.get("entrypoint")
        command = service.get("command")
        if name == "specroute":
            assert entrypoint is None, "specroute runs the image's entrypoint"
            if command is not None:
                check_specroute_command("serve", [compose_value(c) for c in command], compose_file)
        elif entrypoint is not None and entrypoint[0] == "specroute":
            args = [*entrypoint[1:], *command]
            check_specroute_command(args[0], [compose_value(a) for a in args[1:]], f"{compose_file} {name}")


def test_compose_pins_the_sglang_release_the_emulator_speaks() -> None:
    from simulator.emulator.info import SGLANG_VERSION

    image = compose_value(load_compose("compose.yaml")["x-sglang"]["image"])
    name, _, tag = image.partition(":")
    assert name == "lmsysorg/sglang" and tag != "latest"
    assert tag.split("-")[0] == f"v{SGLANG_VERSION}", f"{image}: the emulator speaks SGLang {SGLANG_VERSION}"


def test_compose_profile_has_the_accept_length_its_policy_reads() -> None:
    """`scraped_accept_length` scales eagle's rate by the reported accept length over the
    profile's: a profile without one would make it do nothing, silently."""
    from policies.profile import resolve_profile

    settings = example_settings()
    if not settings.policy_params.get("scraped_accept_length"):
        return
    for name in ("compose.yaml", "compose.emulated.yaml"):
        env = load_compose(name)["services"]["specroute"]["environment"]
        profile = resolve_profile(compose_value(str(env["SPECROUTE_PROFILE"])))
        assert profile.mode("eagle").accept_length, (
            f"{name}: profile {profile.name} has no eagle accept_length"
        )
