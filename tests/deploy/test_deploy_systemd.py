"""deploy/systemd/: the units' structure (restart, environment files, ordering, a stop timeout
longer than the drain, reload by SIGHUP), SGLang command lines with real flags on the ports the
example config names, an accepted `specroute serve` ExecStart, and `systemd-analyze verify`
where it exists."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_files import (
    SGLANG_FLAGS,
    SPECULATIVE_FLAGS,
    SYSTEMD,
    arg_value,
    check_draft_tokens,
    check_specroute_command,
    duration_s,
    example_settings,
    exec_start,
    flag_names,
    read_env_file,
    read_unit,
)


def test_systemd_sglang_units_use_real_flags() -> None:
    commands = {}
    for pool in ("baseline", "eagle"):
        unit = read_unit(SYSTEMD / f"sglang-{pool}.service")
        env = read_env_file(SYSTEMD / f"sglang-{pool}.env")
        (line,) = unit["Service"]["ExecStart"]
        for var in re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", line):
            assert var in env, f"sglang-{pool}.service uses ${var}, not set in sglang-{pool}.env"
        (env_file,) = unit["Service"]["EnvironmentFile"]
        assert env_file == f"/etc/specroute/sglang-{pool}.env"
        words = exec_start(unit, env)
        assert words[1:3] == ["-m", "sglang.launch_server"], words
        flags = flag_names(words[3:])
        assert set(flags) <= SGLANG_FLAGS, set(flags) - SGLANG_FLAGS
        assert "--enable-metrics" in flags
        assert "" not in words
        if pool == "eagle":
            for flag in SPECULATIVE_FLAGS:
                assert flag in flags
            check_draft_tokens(words)
        commands[pool] = words
    for flag in ("--model-path", "--served-model-name"):
        assert arg_value(commands["baseline"], flag) == arg_value(commands["eagle"], flag)
    # the example config points at the ports the units listen on
    settings = example_settings()
    for pool in ("baseline", "eagle"):
        urls = [b.url for b in settings.backends(pool)]  # type: ignore[arg-type]
        assert urls == [f"http://127.0.0.1:{arg_value(commands[pool], '--port')}"]


def test_systemd_units_structure() -> None:
    example = example_settings()
    drain = example.shutdown_grace_s + example.drain_timeout_s
    for path in sorted(SYSTEMD.glob("*.service")):
        unit = read_unit(path)
        assert {"Unit", "Service", "Install"} <= set(unit), path.name
        service = unit["Service"]
        assert service["Restart"] == ["on-failure"], path.name
        assert service.get("EnvironmentFile"), path.name
        assert "network-online.target" in " ".join(unit["Unit"]["After"]), path.name
        assert unit["Install"]["WantedBy"] == ["multi-user.target"]
        assert (SYSTEMD / Path(service["EnvironmentFile"][0]).name).is_file(), "env file not shipped"
    specroute = read_unit(SYSTEMD / "specroute.service")
    for key in ("After", "Wants"):
        names = " ".join(specroute["Unit"][key]).split()
        assert {"sglang-baseline.service", "sglang-eagle.service"} <= set(names), key
    (stop,) = specroute["Service"]["TimeoutStopSec"]
    assert duration_s(stop) > drain, "systemd would SIGKILL specroute before its drain ends"
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


def test_systemd_specroute_command_is_accepted() -> None:
    unit = read_unit(SYSTEMD / "specroute.service")
    env = read_env_file(SYSTEMD / "specroute.env")
    words = exec_start(unit, env)
    assert words[0].endswith("/specroute") and words[1] == "serve", words
    check_specroute_command("serve", words[2:], "specroute.service ExecStart")


def _gpus(value: str) -> set[int]:
    out: set[int] = set()
    for part in value.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def test_the_two_sglang_servers_never_share_a_gpu() -> None:
    """specroute.service starts both SGLang units on one host: their GPUs must be disjoint, and
    each server's tensor parallelism must use exactly the GPUs it is given."""
    gpus = {}
    for pool in ("baseline", "eagle"):
        env = read_env_file(SYSTEMD / f"sglang-{pool}.env")
        gpus[pool] = _gpus(env["CUDA_VISIBLE_DEVICES"])
        assert int(env["TP_SIZE"]) == len(gpus[pool]), pool
    assert not gpus["baseline"] & gpus["eagle"], (
        f"both servers on GPUs {sorted(gpus['baseline'] & gpus['eagle'])}"
    )
    assert max(gpus["baseline"] | gpus["eagle"]) < 8  # one 8-GPU node
