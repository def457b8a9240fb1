"""The emulated stack run as deploy/compose.emulated.yaml runs it, without Docker: the two
emulators and `specroute serve` started from the deploy files' own command lines, answering the
official client (plain and streaming), the image's HEALTHCHECK passing, every dashboard metric
exported, and a decision log written."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from deploy_files import (
    EXAMPLE,
    METRIC_NAME,
    ROOT,
    clean_env,
    compose_value,
    dashboard_queries,
    dockerfile_instructions,
    final_stage,
    healthcheck_command,
    load_compose,
    metric_base_name,
)
from prometheus_client.parser import text_string_to_metric_families

from controller.cli import spawn


def _start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """Start `specroute ARGS` and return it with the URL it prints when listening."""
    proc, line = spawn.start_sync([sys.executable, "-m", "controller.cli", *args], cwd=str(ROOT), env=env)
    return proc, spawn.url_of(line)


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
    services = load_compose("compose.emulated.yaml")["services"]
    final = final_stage(dockerfile_instructions())
    (cmd,) = [json.loads(rest) for ins, rest in final if ins == "CMD"]
    env = clean_env()
    started: list[subprocess.Popen[str]] = []
    try:
        urls = {}
        for pool in ("baseline", "eagle"):
            service = services[f"sglang-{pool}"]
            args = [*service["entrypoint"][1:], *_local(service["command"])]
            proc, urls[pool] = _start(args, env)
            started.append(proc)
        serve_env = env | {k: compose_value(str(v)) for k, v in services["specroute"]["environment"].items()}
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
        probe = [w.replace("127.0.0.1:8000", url.removeprefix("http://")) for w in healthcheck_command()]
        assert probe[0] == "python"
        assert subprocess.run([sys.executable, *probe[1:]], timeout=30).returncode == 0
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            exported = _exported_metric_names(r.read().decode())
        on_dashboard = {
            metric_base_name(m)
            for _, expr in dashboard_queries()
            for m in METRIC_NAME.findall(expr)
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
