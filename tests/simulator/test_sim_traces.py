"""Trace files are parsed once per process, and read again when they change; a decision log
replays only the requests that completed."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import openai
import pytest
from helpers import run_main

from simulator.engine.traces import read_trace, skipped_records

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _write(path: Path, rows: list[tuple[str, int, int]]) -> None:
    path.write_text(HEADER + "".join(f"{t},{c},{g}\n" for t, c, g in rows), encoding="utf-8")


def test_changed_trace_is_read_again_and_callers_cannot_alter_the_cache(tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    _write(trace, [("2023-11-16 18:17:03.0000000", 100, 10), ("2023-11-16 18:17:04.0000000", 200, 20)])
    first = read_trace(trace)
    assert [r.output_tokens for r in first] == [10, 20]
    first.clear()  # a caller's list is its own
    assert len(read_trace(trace)) == 2

    # more rows: a different size
    _write(
        trace,
        [
            ("2023-11-16 18:17:03.0000000", 100, 10),
            ("2023-11-16 18:17:04.0000000", 200, 20),
            ("2023-11-16 18:17:05.0000000", 300, 30),
        ],
    )
    assert [r.output_tokens for r in read_trace(trace)] == [10, 20, 30]

    # same size, new content and a new modification time
    st = trace.stat()
    _write(
        trace,
        [
            ("2023-11-16 18:17:03.0000000", 100, 10),
            ("2023-11-16 18:17:04.0000000", 200, 20),
            ("2023-11-16 18:17:05.0000000", 300, 40),
        ],
    )
    os.utime(trace, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert [r.output_tokens for r in read_trace(trace)] == [10, 20, 40]


async def test_a_decision_log_replays_only_the_requests_that_completed(
    emulator, proxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A live decision log holding a request the backend refused (max_tokens 1e9: 400) and one
    that failed on both pools (500) replays -- in `plan` and `simulate` -- to the same figures
    as the same log without them, and says how many records it skipped and why."""
    base = await emulator("baseline")
    eagle = await emulator("eagle")
    log = tmp_path / "decisions.jsonl"
    p = await proxy(
        baseline=[base.url], eagle=[eagle.url], policy="cost_model", profile="kimi-k25-int4-8gpu",
        decision_log=str(log), health_check_interval_s=60,
    )  # fmt: skip
    client = p.client()
    chat = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.BadRequestError):  # refused first: the replay must not start the clock there
        await client.chat.completions.create(model="m", messages=chat, max_tokens=10**9)
    for server in (base, eagle):
        server.faults.error_rate = 1.0
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model="m", messages=chat, max_tokens=16)
    for server in (base, eagle):
        server.faults.error_rate = 0.0
    for i in range(12):
        await asyncio.sleep(0.05)
        await client.chat.completions.create(model="m", messages=chat, max_tokens=20 + 10 * i)
    await client.close()
    await p.stop()  # drains the decision log's writer

    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(r["status"] for r in records if r["status"] != "ok") == ["client_error", "error"]
    clean = tmp_path / "completed.jsonl"
    clean.write_text("".join(json.dumps(r) + "\n" for r in records if r["status"] == "ok"))
    assert skipped_records(log) == {"client_error": 1, "error": 1} and skipped_records(clean) == {}

    def replay(command: str, trace: Path, *extra: str) -> tuple[str, str]:
        code, out, err = run_main(
            capsys, command, "--profile", "kimi-k25-int4-8gpu", "--workload", "trace", "--trace", str(trace),
            *extra,
        )  # fmt: skip
        assert code == 0, err
        return out.replace(str(trace), "TRACE"), err

    plan_args = ("--servers", "2", "--seeds", "0", "1", "--loads", "1", "--policies", "threshold",
                 "--jobs", "1", "--no-progress", "--json", "--out", str(tmp_path / "plan.yaml"))  # fmt: skip
    for command, extra in (("simulate", ("--json",)), ("plan", plan_args)):
        with_failures, err = replay(command, log, *extra)
        without, _ = replay(command, clean, *extra)
        assert with_failures == without, command
        assert "2 decision-log records skipped (did not complete: client_error 1, error 1)" in err, err
        doc = json.loads(with_failures)
        runs = doc["runs"] if command == "simulate" else doc["loads"][0]["ranking"]
        assert all(r["summary"]["mean_e2e_s"] < 10 for r in runs), runs  # no billion-token answer
    code, out, _ = run_main(capsys, "simulate", "--profile", "kimi-k25-int4-8gpu", "--workload", "trace",
                            "--trace", str(log))  # fmt: skip
    assert code == 0 and "2 decision-log records skipped (did not complete: client_error 1, error 1)" in out
