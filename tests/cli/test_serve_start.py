"""`specroute serve` binds its port before it writes anything: a serve that cannot listen exits
having created no folder and no file (the shipped config logs decisions under /var/log/specroute)."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

from conftest import start_serve
from helpers import ROOT, run_specroute

DEPLOY_CONFIG = ROOT / "deploy" / "specroute.yaml"


async def test_a_serve_that_cannot_listen_creates_no_files(tmp_path: Path) -> None:
    logs = tmp_path / "var" / "log" / "specroute"
    env = {
        **os.environ,
        "SPECROUTE_DECISION_LOG": str(logs / "decisions.jsonl"),
        "SPECROUTE_SHUTDOWN_GRACE_S": "0",
    }
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = await run_specroute(
            "serve", "--config", str(DEPLOY_CONFIG), "--host", "127.0.0.1", "--port", str(port), env=env,
            timeout_s=60,
        )  # fmt: skip
    assert code == 2, err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
    assert "listening" not in out
    assert not (tmp_path / "var").exists()

    # once it listens, it makes the folder and the log as the config says
    served = await start_serve("--config", str(DEPLOY_CONFIG), "--host", "127.0.0.1", env=env)
    try:
        assert (logs / "decisions.jsonl").is_file()
    finally:
        served.signal(signal.SIGTERM)
        assert await served.wait() == 0


async def test_a_decision_log_it_cannot_write_is_still_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = await run_specroute(
        "serve", "--baseline", "http://127.0.0.1:1", "--port", "0",
        "--decision-log", str(blocker / "decisions.jsonl"), timeout_s=60,
    )  # fmt: skip
    assert code == 2 and f"decision_log {blocker / 'decisions.jsonl'}: cannot open for writing" in err
    assert "Traceback" not in err
