"""Decision log: one JSON line per finished request, written off the event loop.

How it works: the request path only appends an item to a queue (no I/O, no JSON encoding on
the event loop). A daemon thread wakes at most every `batch_interval_s` under load, turns the
queued items into dicts (`transform`, e.g. building the record from immutable request data),
encodes and writes the lines, flushes once per batch, and rotates the file by size (`FILE` ->
`FILE.1` -> ... keeping `backups` old files). When the disk falls behind by more than
`max_queued` items, new items are dropped and counted rather than letting memory grow.
`close()` drains what is queued and joins the thread. The records hold routing facts only:
never prompt or answer text.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("specroute.decision_log")

_STOP = object()


class DecisionLog:
    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = 100 * 1024 * 1024,
        backups: int = 5,
        transform: Callable[[Any], Any] | None = None,
        max_queued: int = 100_000,
        batch_interval_s: float = 0.05,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.transform = transform
        self.max_queued = max_queued
        self.batch_interval_s = batch_interval_s
        self._stopping = threading.Event()
        self.dropped = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._size = self._file.tell()
        self._thread = threading.Thread(target=self._run, name="specroute-decision-log", daemon=True)
        self._thread.start()

    def write(self, record: Any) -> None:
        """Queue one record (called on the event loop: never blocks)."""
        if self._queue.qsize() >= self.max_queued:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10_000 == 0:
                log.warning("decision log: writer behind, %d record(s) dropped so far", self.dropped)
            return
        self._queue.put(record)

    def close(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.backups > 0:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._size = 0

    def _write_line(self, record: Any) -> None:
        try:
            if self.transform is not None:
                record = self.transform(record)
            line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        except (TypeError, ValueError, AttributeError, KeyError) as e:
            self.dropped += 1
            log.warning("decision log: record dropped (%s)", e)
            return
        size = len(line.encode("utf-8"))
        if self._size and self._size + size > self.max_bytes:
            self._rotate()
        self._file.write(line)
        self._size += size

    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            if item is not _STOP and self.batch_interval_s > 0:
                # Let a batch gather: one wake-up (and one GIL hand-off) per interval under load
                # instead of one per request.
                self._stopping.wait(self.batch_interval_s)
            batch = [item]
            while True:  # drain whatever else is queued, then flush once
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                for record in batch:
                    if record is _STOP:
                        stop = True
                        continue
                    self._write_line(record)
                self._file.flush()
            except OSError as e:
                self.dropped += len(batch)
                log.error("decision log: write failed: %s", e)
        self._file.close()
