"""The one JSON-lines reader: prompt sets, SGLang benchmark results, decision logs, traces."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class JsonlError(ValueError):
    """A JSON-lines file that cannot be read; the message names the file (and line)."""


def read_jsonl(
    path: str | Path, *, what: str = "", error: Callable[[str], Exception] = JsonlError
) -> Iterator[tuple[str, Any]]:
    """(`FILE:LINE`, decoded value) for every non-blank line of `path`, read lazily.

    An unreadable file, a line that is not JSON or bytes that are not UTF-8 raise
    `error(message)` (the caller's own error type), the message naming the file and line;
    `what` names the content in the message ("cannot read trace")."""
    p = Path(path)
    noun = f" {what}" if what else ""
    try:
        with p.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{p}:{n}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise error(f"{p}:{n}: not valid JSON: {e.msg}") from None
    except OSError as e:
        raise error(f"{p}: cannot read{noun}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise error(f"{p}: not a text file") from None
