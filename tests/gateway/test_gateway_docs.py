"""docs/gateway.md's example runs as written: its two emulators, the picker, Envoy from PyPI on
deploy/gateway/envoy.yaml and the curl line, each command as the page has it but for its ports
(free ones here: other tests run beside this one), and the answer is a routed chat completion."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shlex
import shutil
from pathlib import Path

import aiohttp
import pytest
from gateway_setup import ENVOY_YAML, ROOT, envoy_binary
from helpers import free_port, metric_samples, start_module, wait_until

PAGE = ROOT / "docs" / "gateway.md"


def _example() -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    block = re.search(r"## Try it with Envoy.*?```bash\n(.*?)```", text, re.S)
    assert block is not None, "docs/gateway.md has no example block under 'Try it with Envoy'"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def _ports(commands: list[str]) -> dict[str, str]:
    """Every port the example names (in its commands and in envoy.yaml) -> a free one."""
    named = set(re.findall(r"(?::|--port |--metrics-port )(\d{4,5})\b", " ".join(commands)))
    named |= set(re.findall(r"port_value: (\d+)", ENVOY_YAML.read_text()))
    return {p: str(free_port()) for p in named}


def _moved(text: str, ports: dict[str, str]) -> str:
    return re.sub(r"(?<![\d.])(\d{4,5})(?!\d)", lambda m: ports.get(m.group(1), m.group(1)), text)


async def test_the_documented_example_runs(tmp_path: Path) -> None:
    binary = envoy_binary()
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed: the example's last line cannot run")
    commands = _example()
    assert [c.split()[:2] for c in commands] == [
        ["specroute", "emulate"], ["specroute", "emulate"], ["specroute", "picker"], ["envoy", "-c"],
        ["curl", "-s"],
    ]  # fmt: skip
    ports = _ports(commands)
    config = tmp_path / "envoy.yaml"
    config.write_text(_moved(ENVOY_YAML.read_text(), ports))
    procs: list[asyncio.subprocess.Process] = []
    try:
        for command in commands[:3]:
            args = shlex.split(_moved(command, ports))[1:]
            proc, _ = await start_module("controller.cli", *args, stderr=asyncio.subprocess.DEVNULL)
            procs.append(proc)
        envoy_args = shlex.split(_moved(commands[3], ports))
        envoy_args[envoy_args.index("-c") + 1] = str(config)
        envoy = await asyncio.create_subprocess_exec(
            binary, *envoy_args[1:], "--disable-hot-restart", cwd=str(ROOT),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(envoy)
        admin = f"http://127.0.0.1:{ports['9901']}"

        async def envoy_ready() -> bool:
            try:
                async with aiohttp.ClientSession() as s, s.get(admin + "/ready") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        assert await wait_until(envoy_ready, timeout_s=60, interval_s=0.2)
        out = await asyncio.create_subprocess_exec(
            curl, *shlex.split(_moved(commands[4], ports))[1:], stdout=asyncio.subprocess.PIPE
        )
        body, _ = await out.communicate()
        answer = json.loads(body)
        assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] == 16
        decisions = await metric_samples(f"http://127.0.0.1:{ports['9090']}", "specroute_decisions_total")
        assert sum(decisions.values()) == 1
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in procs:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 15)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
