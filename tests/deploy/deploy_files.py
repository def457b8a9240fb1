"""What the deploy/ tests share (imported as `from deploy_files import ...`): where the files
are, the SGLang flags and metric names they may use, and small readers of the formats deploy/
holds -- YAML documents, compose interpolation, systemd units and environment files, the
Dockerfile's instructions, the Grafana dashboard's queries -- plus `check_specroute_command`, which
runs a deploy file's `specroute` command line through the real CLI parser and its `--help`, and
`registered_metrics`, the metric names a real `specroute serve` exports.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from controller.cli import build_parser, spawn
from controller.proxy.config import Settings, load_settings

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


@functools.cache
def registered_metrics() -> frozenset[str]:
    """The metric families a real `specroute serve` exports, every optional part on (a config
    file to reload, a decision log, a state file, an admin token), as the exposition names them
    (counters with `_total`; prometheus_client's `_created` series are not metrics of their own)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "specroute.yaml"
        config.write_text(
            "baseline: [http://127.0.0.1:9]\neagle: [http://127.0.0.1:10]\nprofile: kimi-k25-int4-8gpu\n"
            f"decision_log: {tmp}/decisions.jsonl\nstate_file: {tmp}/state.json\n"
        )
        env = clean_env() | {"SPECROUTE_ADMIN_TOKEN": "t", "SPECROUTE_SHUTDOWN_GRACE_S": "0"}
        proc, line = spawn.start_sync(
            [sys.executable, "-m", "controller.cli", "serve", "--config", str(config), "--port", "0"],
            stderr=subprocess.DEVNULL, env=env, cwd=str(ROOT),
        )  # fmt: skip
        try:
            with urllib.request.urlopen(spawn.url_of(line) + "/metrics", timeout=30) as r:
                text = r.read().decode()
        finally:
            spawn.stop_sync(proc)
    names = set()
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return frozenset(names)


# SGLang's metric names (docs/SGLANG_PROTOCOL.md, "Load signals"): the dashboard may query these.
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


def clean_env() -> dict[str, str]:
    """This process's environment without SPECROUTE_* (they would override the files)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SPECROUTE_")}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controller.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env() if env is None else env,
    )


def subcommands() -> set[str]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action.choices, dict):
            return set(action.choices)
    return set()


def help_flags(command: str) -> set[str]:
    proc = run_cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    return set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", proc.stdout))


def flag_names(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def check_specroute_command(command: str, args: list[str], where: str) -> None:
    """`specroute <command> *args` parses with the real parser and uses only --help's flags."""
    if command not in subcommands():
        if command == "serve":
            pytest.fail("`specroute serve` does not exist")
        pytest.skip(f"`specroute {command}` is not wired into the CLI yet")
    unknown = set(flag_names(args)) - help_flags(command)
    assert not unknown, f"{where}: `specroute {command} --help` does not list {sorted(unknown)}"
    try:
        build_parser().parse_args([command, *args])
    except SystemExit as e:
        pytest.fail(f"{where}: `specroute {command} {shlex.join(args)}` is rejected by the CLI ({e})")


def yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def load_compose(name: str) -> dict[str, Any]:
    data = yaml.safe_load((DEPLOY / name).read_text())
    assert isinstance(data, dict)
    return data


_DEFAULT = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


def compose_value(value: str) -> str:
    """Compose interpolation with the defaults the file gives (${X:-default} -> default)."""
    return _DEFAULT.sub(lambda m: m.group(2) or "", value)


def arg_value(args: list[str], flag: str) -> str:
    i = args.index(flag)
    return args[i + 1]


def example_settings() -> Settings:
    return load_settings(environ={}, config_file=EXAMPLE)


def config_map_generator() -> dict[str, Any]:
    """kustomization.yaml's one configMapGenerator entry (the specroute config)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    assert isinstance(generator, dict)
    return generator


def configmap_config(tmp_path: Path) -> Path:
    """The config file the ConfigMap is generated from (its one key, specroute.yaml)."""
    (name,) = config_map_generator()["files"]
    assert name == "specroute.yaml"
    return K8S / name


def k8s_deployment() -> dict[str, Any]:
    (dep,) = yaml_docs(K8S / "deployment.yaml")
    assert isinstance(dep, dict)
    return dep


# systemd unit files: sections of `Key=value` lines, `\` continues a line, keys may repeat.
def read_unit(path: Path) -> dict[str, dict[str, list[str]]]:
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


def read_env_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=value: {line!r}"
        out[key.strip()] = value.strip()
    return out


def exec_start(unit: dict[str, dict[str, list[str]]], env: dict[str, str]) -> list[str]:
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


def duration_s(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|min|m)?", value.strip())
    assert m, f"cannot read a duration from {value!r}"
    return float(m.group(1)) * (60 if m.group(2) in ("min", "m") else 1)


def dockerfile_instructions() -> list[tuple[str, str]]:
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


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (ins, _) in enumerate(instructions) if ins == "FROM"]
    return instructions[starts[-1] :]


def healthcheck_command() -> list[str]:
    (healthcheck,) = [rest for ins, rest in final_stage(dockerfile_instructions()) if ins == "HEALTHCHECK"]
    _, sep, exec_form = healthcheck.partition(" CMD ")
    assert sep, "HEALTHCHECK needs a CMD"
    command = json.loads(exec_form)
    assert isinstance(command, list)
    return [str(w) for w in command]


def check_draft_tokens(command: list[str]) -> None:
    assert arg_value(command, "--speculative-algorithm") == "EAGLE3"
    if arg_value(command, "--speculative-eagle-topk") == "1":
        steps = int(arg_value(command, "--speculative-num-steps"))
        assert int(arg_value(command, "--speculative-num-draft-tokens")) == steps + 1


def dashboard() -> dict[str, Any]:
    data = json.loads((DEPLOY / "grafana" / "specroute.json").read_text())
    assert isinstance(data, dict)
    return data


def dashboard_queries() -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


METRIC_NAME = re.compile(r"\b(specroute_[a-z0-9_]+|sglang:[a-z0-9_:]+)")


def metric_base_name(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name
