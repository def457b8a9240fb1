"""Trace files are parsed once per process, and read again when they change."""

from __future__ import annotations

import os
from pathlib import Path

from simulator.engine.traces import read_trace

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
