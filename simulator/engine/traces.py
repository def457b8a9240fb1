"""Trace files for replay: the Azure LLM inference trace CSV, Mooncake's trace and specroute's
decision log.

Azure (Patel et al., "Splitwise", ISCA 2024; CC-BY-4.0): a CSV with the header
`TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps like `2023-11-16 18:17:03.9799600`.

Mooncake (Qin et al., "Mooncake", FAST 2025; kvcache-ai/Mooncake, Apache-2.0): JSONL, one
request per line, with `timestamp` (ms from the start), `input_length` and `output_length`
(tokens) and `hash_ids`, the ids of the prompt's 512-token blocks in order (two requests share a
prefix exactly as far as their leading ids agree). The ids become the records' `blocks`.

Decision log (written by the proxy): JSONL, one object per finished request, with `ts` (arrival,
unix seconds), `prompt_tokens`, `max_tokens`, `completion_tokens`, `hint` and `status`. Only
requests that completed (`status` "ok", or no `status`: a hand-written trace) are replayed: a
request the backend refused or that failed never did the work its `max_tokens` asks for (a
refused `max_tokens` of 1e9 would replay as a billion-token answer), so it is skipped and counted
by status (`skipped_records`), before the times are made relative to the first arrival. Lines are
written when requests finish, so they are re-sorted by arrival here.

Times are returned relative to the first arrival. The format is detected from the first
non-empty line when not given.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from policies.jsonl import read_jsonl

TraceFormat = Literal["azure", "mooncake", "specroute-log"]
TRACE_FORMATS: tuple[TraceFormat, ...] = ("azure", "mooncake", "specroute-log")
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class TraceRecord:
    t: float
    """Arrival, seconds after the first request of the trace."""
    prompt_tokens: int
    output_tokens: int | None
    """None when the trace does not say (the caller draws a length)."""
    max_tokens: int | None
    hint: str | None
    blocks: tuple[int, ...] | None = None
    """The prompt's block ids (Mooncake's `hash_ids`), or None when the trace has none."""


def detect_format(path: Path) -> TraceFormat:
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                text = line.strip()
                if not text:
                    continue
                if text.startswith("{"):
                    return "mooncake" if '"hash_ids"' in text else "specroute-log"
                if "TIMESTAMP" in text and "GeneratedTokens" in text:
                    return "azure"
                break
    except OSError as e:
        raise TraceError(f"{path}: cannot read trace: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file") from None
    raise TraceError(
        f"{path}: cannot tell the trace format (expected an Azure CSV header "
        "'TIMESTAMP,ContextTokens,GeneratedTokens', Mooncake JSONL lines with 'hash_ids' or "
        "JSONL decision-log lines); "
        "give --trace-format"
    )


_CACHE_SIZE = 4
_cache: dict[tuple[str, int, int, TraceFormat | None], tuple[list[TraceRecord], dict[str, int]]] = {}
"""Parsed traces of this process (a tune or plan simulates the same trace in every task), keyed by
file, modification time, size and format: a changed file is read again."""


def _load(path: str | Path, fmt: TraceFormat | None) -> tuple[list[TraceRecord], dict[str, int]]:
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such trace file")
    try:
        st = p.stat()
    except OSError as e:
        raise TraceError(f"{p}: cannot read trace: {e.strerror or e}") from None
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size, fmt)
    parsed = _cache.get(key)
    if parsed is None:
        parsed = _parse(p, fmt)
        while len(_cache) >= _CACHE_SIZE:
            del _cache[next(iter(_cache))]
        _cache[key] = parsed
    return parsed


def read_trace(
    path: str | Path, fmt: TraceFormat | None = None, limit: int | None = None
) -> list[TraceRecord]:
    """Records sorted by arrival (stable), at most `limit` of them."""
    records = _load(path, fmt)[0]
    return records[:limit] if limit is not None else list(records)


def skipped_records(path: str | Path, fmt: TraceFormat | None = None) -> dict[str, int]:
    """Decision-log records left out because the request did not complete: count per `status`
    (empty for other formats and for logs of completed requests only)."""
    return dict(_load(path, fmt)[1])


def describe_skipped(skipped: dict[str, int]) -> str | None:
    """`N decision-log records skipped (did not complete: error 2, client_error 1)`, or None."""
    if not skipped:
        return None
    total = sum(skipped.values())
    parts = ", ".join(f"{status} {n}" for status, n in sorted(skipped.items()))
    return f"{total} decision-log record{'s' * (total != 1)} skipped (did not complete: {parts})"


def _parse(p: Path, fmt: TraceFormat | None) -> tuple[list[TraceRecord], dict[str, int]]:
    """All records, sorted by arrival (stable), times relative to the first; and the decision-log
    records skipped, per status."""
    guessed = fmt is None
    fmt = fmt or detect_format(p)
    skipped: dict[str, int] = {}
    if fmt == "azure":
        records = _read_azure(p)
    elif fmt == "mooncake":
        records = _read_mooncake(p)
    else:
        records = _read_log(p, guessed, skipped)
    if not records and skipped:
        raise TraceError(f"{p}: the trace has no requests that completed ({describe_skipped(skipped)})")
    if not records:
        raise TraceError(f"{p}: the trace has no requests")
    records.sort(key=lambda r: r.t)
    t0 = records[0].t
    shifted = [
        TraceRecord(r.t - t0, r.prompt_tokens, r.output_tokens, r.max_tokens, r.hint, r.blocks)
        for r in records
    ]
    return shifted, skipped


def _read_azure(p: Path) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    try:
        with p.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
            if missing:
                raise TraceError(f"{p}: not an Azure trace: missing column(s) {', '.join(sorted(missing))}")
            epoch: datetime | None = None
            for row in reader:
                line = reader.line_num
                try:
                    ts = datetime.fromisoformat(row["TIMESTAMP"].strip())
                    prompt = int(row["ContextTokens"])
                    gen = int(row["GeneratedTokens"])
                except (ValueError, TypeError, AttributeError):
                    raise TraceError(f"{p}:{line}: bad row {row!r}") from None
                if prompt < 0 or gen < 0:
                    raise TraceError(f"{p}:{line}: negative token count")
                epoch = epoch or ts
                t = (ts - epoch).total_seconds()
                out.append(TraceRecord(t, prompt, max(gen, 1), max(gen, 1), None))
    except OSError as e:
        raise TraceError(f"{p}: cannot read trace: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{p}: not a text file") from None
    return out


def _opt_int(obj: dict[str, Any], key: str, where: str) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceError(f"{where}: {key!r} must be a non-negative integer or null, got {v!r}")
    return v


_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")


COMPLETED = "ok"
"""The decision log's `status` of a request that completed (`policies.values.OutcomeStatus`)."""


def _read_log(p: Path, guessed: bool = False, skipped: dict[str, int] | None = None) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    for where, obj in read_jsonl(p, what="trace", error=TraceError):
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object")
        ts = obj.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, int | float):
            if guessed:
                raise TraceError(_log_format_guess(where, obj))
            raise TraceError(f"{where}: 'ts' must be a number (arrival unix seconds)")
        status = obj.get("status", COMPLETED)
        if status != COMPLETED:
            if skipped is not None:
                key = status if isinstance(status, str) else repr(status)
                skipped[key] = skipped.get(key, 0) + 1
            continue
        prompt = _opt_int(obj, "prompt_tokens", where) or 0
        completion = _opt_int(obj, "completion_tokens", where)
        max_tokens = _opt_int(obj, "max_tokens", where)
        hint = obj.get("hint")
        if hint is not None and not isinstance(hint, str):
            raise TraceError(f"{where}: 'hint' must be a string or null")
        output = completion if completion else max_tokens
        out.append(TraceRecord(float(ts), prompt, output or None, max_tokens, hint))
    return out


def _log_format_guess(where: str, obj: dict[str, Any]) -> str:
    """The error for a JSON-lines trace read as a decision log by guess, whose line lacks 'ts':
    which format was guessed and why, what it needs, and what the line looks like instead."""
    head = (
        f"{where}: the format was guessed as 'specroute-log' (JSON lines without 'hash_ids'), "
        "which needs 'ts' (arrival, unix seconds), 'prompt_tokens' and 'completion_tokens' or 'max_tokens'"
    )
    present = [k for k in _MOONCAKE_KEYS if k in obj]
    if present:
        return (
            f"{head}; this line has Mooncake's {', '.join(repr(k) for k in present)} but no 'hash_ids' "
            f"(the ids of the prompt's {MOONCAKE_BLOCK_TOKENS}-token blocks, which the Mooncake format "
            "requires): add them, or convert the lines to the decision-log keys"
        )
    keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
    return f"{head}; this line has {keys}: give --trace-format if it is another format"


def _read_mooncake(p: Path) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    for where, obj in read_jsonl(p, what="trace", error=TraceError):
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object")
        ts = obj.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not ts >= 0:
            raise TraceError(f"{where}: 'timestamp' must be a number >= 0 (ms from the start)")
        prompt = _opt_int(obj, "input_length", where)
        output = _opt_int(obj, "output_length", where)
        if prompt is None or output is None:
            raise TraceError(f"{where}: 'input_length' and 'output_length' are required")
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or any(
            isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids
        ):
            raise TraceError(f"{where}: 'hash_ids' must be a list of non-negative integers")
        blocks = -(-prompt // MOONCAKE_BLOCK_TOKENS)
        if len(ids) != blocks:
            raise TraceError(
                f"{where}: {len(ids)} hash_ids for input_length {prompt} "
                f"(expected {blocks}, one per {MOONCAKE_BLOCK_TOKENS}-token block)"
            )
        out.append(TraceRecord(ts / 1000.0, prompt, max(output, 1), max(output, 1), None, tuple(ids)))
    return out
