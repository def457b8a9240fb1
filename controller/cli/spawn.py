"""Start a child process and wait for the line that says where it listens.

`specroute serve` prints `specroute listening on URL` on stdout once its socket is bound, and
`specroute emulate` prints `emulator (MODE) listening on URL`; neither prints it earlier, so a
supervisor may act on it. Whoever starts one as a child -- the demo, the tests, the benchmarks --
waits for that line the same way, here: read stdout line by line until one contains the marker
(earlier lines are skipped), within a deadline; if the child ends or stays silent first, kill it
and raise `StartError` with what it said (stderr's tail when stderr is a pipe).

This module is in the package (not in `tests/` or `benchmarks/`) because all three import the
package, while neither of the other two folders is importable from the other. There are two
flavours of one rule: `start`/`read_listening` for asyncio callers (tests, the demo), and
`start_sync`/`read_listening_sync` for plain-thread ones (most benchmarks, synchronous tests).
The child's side, for a small aiohttp server a benchmark runs as a child: `listen`.
"""

from __future__ import annotations

import asyncio
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

MARKER = "listening on "
"""What both `serve` and `emulate` print before their URL."""

Stream = int | IO[Any] | None
"""A child's stderr: `subprocess.PIPE`, `DEVNULL`, an open file, or None (inherit)."""


async def listen(app: Any, **runner_options: Any) -> Any:
    """Serve the aiohttp `app` on 127.0.0.1 at a free port and print the listening line (what
    `read_listening` waits for); returns its `web.AppRunner` (the caller keeps it running)."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None, **runner_options)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(f"{MARKER}http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    return runner


class StartError(RuntimeError):
    """A child ended, or said nothing matching, before its listening line."""


def url_of(line: str, marker: str = MARKER) -> str:
    """The URL in a listening line: the text after `marker` (`MARKER` ends in a space)."""
    return line.split(marker, 1)[1].strip()


def _failure(what: str, seen: Sequence[str], err: bytes | str, timeout_s: float, ended: bool) -> StartError:
    why = "ended" if ended else f"printed no listening line within {timeout_s:g} s"
    text = err.decode(errors="replace") if isinstance(err, bytes) else err
    return StartError(f"{what} {why}; stdout: {list(seen)[-5:]!r}; stderr ends: {text[-2000:]!r}")


async def read_listening(
    proc: asyncio.subprocess.Process, *, marker: str = MARKER, timeout_s: float = 60.0, what: str = "child"
) -> str:
    """The first stdout line of `proc` (stripped) that contains `marker`. On end of output or
    timeout, `proc` is killed and reaped and `StartError` raised."""
    assert proc.stdout is not None, "start the child with stdout=PIPE"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    seen: list[str] = []
    ended = False
    try:
        while True:
            raw = await asyncio.wait_for(proc.stdout.readline(), max(deadline - loop.time(), 0.0))
            if not raw:
                ended = True
                break
            line = raw.decode(errors="replace").strip()
            if marker in line:
                return line
            seen.append(line)
    except TimeoutError:
        pass
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode is None:
        proc.kill()
    await proc.wait()
    err = await proc.stderr.read() if proc.stderr is not None else b""
    raise _failure(what, seen, err, timeout_s, ended)


async def start(
    cmd: Sequence[str],
    *,
    marker: str = MARKER,
    timeout_s: float = 60.0,
    stderr: Stream = subprocess.PIPE,
    stdin: Stream = subprocess.DEVNULL,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    preexec_fn: Callable[[], Any] | None = None,
) -> tuple[asyncio.subprocess.Process, str]:
    """Run `cmd` with stdout piped; the process and its listening line (see `read_listening`).
    A piped stderr that nobody reads can fill and stall a chatty child: pass a file or DEVNULL
    for one that logs a lot."""
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=subprocess.PIPE, stderr=stderr, stdin=stdin, env=env, cwd=cwd, preexec_fn=preexec_fn
    )
    line = await read_listening(proc, marker=marker, timeout_s=timeout_s, what=" ".join(cmd[:4]))
    return proc, line


def read_listening_sync(
    proc: subprocess.Popen[str], *, marker: str = MARKER, timeout_s: float = 60.0, what: str = "child"
) -> str:
    """`read_listening` for a text-mode `Popen`. The lines are read by a short-lived thread (a
    `select` on the pipe would miss lines already in the text buffer), which stops at the
    listening line, so whatever the child prints after it is left for the caller."""
    assert proc.stdout is not None, "start the child with stdout=PIPE, text=True"
    stdout = proc.stdout
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        while True:
            line = stdout.readline()
            lines.put(line)
            if not line or marker in line:
                return

    threading.Thread(target=pump, name="spawn-read", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    ended = False
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if marker in line:
            return line.strip()
        if not line:
            ended = True
            break
        seen.append(line.strip())
    proc.kill()
    err = ""
    try:
        proc.wait(timeout=10)
        if proc.stderr is not None:
            err = proc.stderr.read()
    except (subprocess.TimeoutExpired, OSError, ValueError):
        pass
    raise _failure(what, seen, err or "", timeout_s, ended)


def start_sync(
    cmd: Sequence[str],
    *,
    marker: str = MARKER,
    timeout_s: float = 60.0,
    stderr: Stream = subprocess.PIPE,
    stdin: Stream = subprocess.DEVNULL,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> tuple[subprocess.Popen[str], str]:
    """`start` for plain-thread callers: a text-mode `Popen` and its listening line."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=stderr, stdin=stdin, env=env, cwd=cwd, text=True
    )
    return proc, read_listening_sync(proc, marker=marker, timeout_s=timeout_s, what=" ".join(cmd[:4]))


def stop_sync(proc: subprocess.Popen[str], timeout_s: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after `timeout_s`; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
