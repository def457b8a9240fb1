"""Decision log: one JSON line per finished request, written off the event loop.

How it works: the request path only appends an item to a queue (no I/O, no JSON encoding on
the event loop). A daemon thread wakes at most every `batch_interval_s` under load, turns the
queued items into dicts (`transform`, e.g. building the record from immutable request data),
encodes them and appends the batch's lines to the file in one `write` of whole lines. The file
is rotated by size (`FILE` -> `FILE.1` -> ... keeping `backups` old files).

What the file always holds is whole lines: a write that fails part way (the disk is full, an
I/O error) is cut back (`ftruncate`) to the end of the last line it wrote completely, and the
records of that batch that did not make it are dropped and counted; the next batch tries again,
so writing resumes by itself once there is room, and serving never waits for the disk. Before
each batch the writer checks that `path` is still the file it has open (same device and
inode): a file removed or moved away (external rotation, `logrotate` without `copytruncate`)
is noticed and `path` is opened anew; `reopen()` (serve calls it on SIGHUP) does the same at
once. What waits for the disk is bounded in bytes: each item is queued with the bytes it holds
(the caller's estimate), counted until its batch has been written (or dropped), so a disk or
mount that hangs in `write` holds at most `max_queued_bytes` of records, the batch it is stuck
on included; past it new items are dropped and counted rather than letting memory grow. Every
drop is reported to `on_drop(reason, n)` (reasons: `queue_full`, `write_error`, `unencodable`).
`close()` drains what is queued and joins the thread. The records hold routing facts only:
never prompt or answer text.
"""

from __future__ import annotations

import errno
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
_REOPEN = object()
_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)

Writer = Callable[[int, memoryview], int]
"""`os.write`'s shape: the file system seam (tests inject ENOSPC through it)."""


class DecisionLog:
    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = 100 * 1024 * 1024,
        backups: int = 5,
        transform: Callable[[Any], Any] | None = None,
        max_queued_bytes: int = 32 * 1024 * 1024,
        batch_interval_s: float = 0.05,
        on_drop: Callable[[str, int], None] | None = None,
        write: Writer = os.write,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.transform = transform
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        """What the queued items and the batch being written hold, by the writers' estimates."""
        self.batch_interval_s = batch_interval_s
        self.on_drop = on_drop
        self._write = write
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.dropped = 0
        """Records dropped so far, for every reason."""
        self._failing = 0  # records dropped since writes began failing (0: writes succeed)
        self._torn: int | None = None  # size to cut the open file back to before the next write
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._open()
        self._thread = threading.Thread(target=self._run, name="specroute-decision-log", daemon=True)
        self._thread.start()

    # -- the event loop's side --

    def write(self, record: Any, size: int = 0) -> None:
        """Queue one record holding about `size` bytes (called on the event loop: never blocks)."""
        with self._lock:
            full = self.queued_bytes + size > self.max_queued_bytes
            if not full:
                self.queued_bytes += size
        if full:
            n = self._drop("queue_full", 1)
            if n == 1 or n % 10_000 == 0:
                log.warning(
                    "decision log: writer behind (%d bytes queued), %d record(s) dropped so far",
                    self.queued_bytes, n,
                )  # fmt: skip
            return
        self._queue.put((record, size))

    def unencodable(self, e: Exception) -> None:
        """Count a record that could not be built or encoded (it costs only itself)."""
        self._drop("unencodable", 1)
        log.warning("decision log: record dropped (%s: %s)", type(e).__name__, e)

    def reopen(self) -> None:
        """Open `path` anew before the next write (after an external rotation: SIGHUP)."""
        self._queue.put(_REOPEN)

    def close(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # -- the writer thread --

    def _drop(self, reason: str, n: int) -> int:
        with self._lock:
            self.dropped += n
            total = self.dropped
        if self.on_drop is not None:
            self.on_drop(reason, n)
        return total

    def _open(self) -> int:
        return os.open(self.path, _FLAGS, 0o644)

    def _reopen(self, why: str) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = self._open()
        except OSError as e:
            log.error("decision log: cannot reopen %s (%s): %s", self.path, why, e.strerror or e)
            return  # keep the old descriptor; the next batch tries again
        old, self._fd = self._fd, fd
        if os.fstat(old).st_ino != os.fstat(fd).st_ino:
            self._torn = None  # a torn line left in the old file stays out of the new one
        os.close(old)
        log.info("decision log: %s %s: reopened", self.path, why)

    def _check_path(self) -> None:
        """Reopen when `path` is no longer the file that is open (removed, or moved away)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._reopen("was removed")
            return
        except OSError:
            return
        mine = os.fstat(self._fd)
        if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
            self._reopen("was replaced (rotated)")

    def _rotate(self) -> None:
        try:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            if self.backups > 0:
                os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
            else:
                self.path.unlink(missing_ok=True)
        except OSError as e:  # keep writing where we are: a log past max_bytes beats lost records
            log.error("decision log: cannot rotate %s: %s", self.path, e.strerror or e)
            return
        self._reopen("reached max_bytes")

    def _encode(self, record: Any) -> str | None:
        try:
            if self.transform is not None:
                record = self.transform(record)
            return json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        except Exception as e:  # a record that cannot be written must not cost the others
            self.unencodable(e)
            return None

    def _append(self, lines: list[str]) -> None:
        """Append whole lines, rotating by size between lines."""
        if self._torn is not None:
            try:
                os.ftruncate(self._fd, self._torn)
            except OSError:
                self._drop("write_error", len(lines))
                self._failing += len(lines)
                return
            self._torn = None
        size = os.fstat(self._fd).st_size
        data = "".join(lines).encode("utf-8")
        if size + len(data) <= self.max_bytes:  # the usual case: no rotation inside the batch
            self._resumed(self._append_whole(lines, data, size))
            return
        segment: list[str] = []
        seg_bytes = 0
        for line in lines:
            n = len(line.encode("utf-8"))
            if size + seg_bytes and size + seg_bytes + n > self.max_bytes:
                if segment and not self._append_whole(segment, "".join(segment).encode("utf-8"), size):
                    self._drop("write_error", len(lines) - len(segment))
                    self._failing += len(lines) - len(segment)
                    return
                lines = lines[len(segment) :]
                segment, seg_bytes = [], 0
                self._rotate()
                size = os.fstat(self._fd).st_size
            segment.append(line)
            seg_bytes += n
        self._resumed(self._append_whole(segment, "".join(segment).encode("utf-8"), size))

    def _resumed(self, ok: bool) -> None:
        if ok and self._failing:
            log.warning("decision log: writing again; %d record(s) were dropped", self._failing)
            self._failing = 0

    def _append_whole(self, lines: list[str], data: bytes, start: int) -> bool:
        """One write of `data` (the whole `lines`) at the end of a file of `start` bytes; on a
        failure the file is cut back to its last whole line and the lines that did not make it
        are counted."""
        buf = memoryview(data)
        done = 0
        try:
            while done < len(buf):
                n = self._write(self._fd, buf[done:])
                if n <= 0:
                    raise OSError(errno.EIO, "write wrote nothing")
                done += n
        except OSError as e:
            kept, whole = 0, 0
            for line in lines:
                n = len(line.encode("utf-8"))
                if whole + n > done:
                    break
                whole += n
                kept += 1
            if done > whole:
                try:
                    os.ftruncate(self._fd, start + whole)  # the torn line goes
                except OSError as e2:
                    # Nothing is appended until it is cut: a line written after it would be torn too.
                    self._torn = start + whole
                    log.error("decision log: cannot cut a torn line off %s: %s", self.path, e2.strerror or e2)
            lost = len(lines) - kept
            self._drop("write_error", lost)
            if not self._failing:
                log.error(
                    "decision log: write to %s failed (%s): dropping records until it works again",
                    self.path,
                    e.strerror or e,
                )
            self._failing += lost
            return False
        return True

    def _batch(self) -> tuple[list[tuple[Any, int]], bool, bool]:
        """The next batch: ((record, size) pairs, reopen asked for, stop asked for)."""
        item = self._queue.get()
        if item is not _STOP and self.batch_interval_s > 0:
            # Let a batch gather: one wake-up (and one GIL hand-off) per interval under load
            # instead of one per request.
            self._stopping.wait(self.batch_interval_s)
        items = [item]
        while True:  # drain whatever else is queued, then write once
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        reopen = any(x is _REOPEN for x in items)
        stop = any(x is _STOP for x in items)
        return [x for x in items if x is not _REOPEN and x is not _STOP], reopen, stop

    def _run(self) -> None:
        stop = False
        while not stop:
            batch, reopen, stop = self._batch()
            self._write_batch(batch, reopen)
            size = sum(n for _, n in batch)
            batch.clear()  # not held while the next batch is awaited: it no longer counts
            with self._lock:
                self.queued_bytes -= size
        os.close(self._fd)

    def _write_batch(self, batch: list[tuple[Any, int]], reopen: bool) -> None:
        try:
            if reopen:
                self._reopen("asked to (SIGHUP)")
            else:
                self._check_path()
            lines = [line for record, _ in batch if (line := self._encode(record)) is not None]
            if lines:
                self._append(lines)
        except Exception as e:  # the writer must outlive any one batch
            self._drop("write_error", len(batch))
            log.error("decision log: batch dropped: %s: %s", type(e).__name__, e)
