"""Soak: ten minutes of mixed load with misbehaving clients and backends through `specroute serve`.

Processes: two emulated SGLang servers (baseline and eagle, kimi-k25-int4-8gpu speeds, each its
own process so it can be frozen with SIGSTOP; faults set through its stdin), `specroute serve`
(cost_model, small admission bounds so the queue and 429 are exercised), and a prober that GETs
/health every 5 ms and samples serve's RSS (`hostile_bodies.py --role probe`). This process runs
the clients:

  normal        closed-loop chat (streaming or not) and completions (not streaming), 8..200 tokens
  slow          streams read 512 bytes at a time with pauses
  stoppers      streams of 4000 tokens whose client reads one event, then nothing for 20 s
  disconnectors streams closed after 1-3 events
  hostile       a 4 MiB body of `[],[],...` every 2 s (413), a header that is not UTF-8 (400),
                a 30 MB prose body (issue 25's row L: served, or 503 when the memory budget is
                held), a gzip body inflating to 30 MB (row L2: 413 by its compression ratio),
                a chat request with n 300 and a completions one with 300 prompts (issue 37's
                finding 2: 400) and one with n 2 (served)
  info          every second, 4 GETs at once of each of /server_info, /model_info and /v1/models
                (issue 37's finding 4: 502 info_answer_too_large while the rogue answers 40 MB)
  slow readers  streams of 4,000 tokens with top_logprobs 20 and the shared system prompt, each
                answer the eagle pool served read at 32 KB/s for 25 s, then at once (issue 37's
                finding 1, `slow_reader.py`'s attacker: its outcomes must teach no policy)

The baseline pool has a second backend, `rogue` (`rogue_backend.py`, listed first, so the info
routes ask it first), which relays to the baseline emulator and misbehaves on cue as issue 25's
hostile probe did (rows K, B, I, C, G, H, M, J, A; L and L2 are the hostile clients') and as
issue 37's did (N: NaN and +Inf on /metrics and /v1/loads; S: 40 MB info answers). serve runs
from a config file holding an `admin_token` (row D: no log line may show it), `backend_header:
false` (row N: no answer a client reads may name a backend) and a decision log (row F) whose queue
holds 256 KiB (`decision_log_queue_bytes`, so its 8 s stall overflows it).

A fault schedule repeats every 180 s, one 10 s slot each: eagle answers 500 (5 s), baseline
stalls past first_byte_timeout_s (5 s), eagle frozen with SIGSTOP (6 s), baseline drops streams
after 3 chunks (5 s), eagle refuses connections (4 s), baseline fails its health probe (5 s),
then the rogue's modes K, B, N, I, C, G, H, M, J, A, S (5 s each). Operations, once a cycle: the
decision log renamed away and SIGHUP (logrotate), the config file rewritten in two parts around
a SIGHUP (row E), the decision log removed, and the decision log stalled for 8 s (issue 37's
finding 6: its path becomes a FIFO nobody reads, SIGHUP; then it is read out and replaced by a
file, SIGHUP).

Afterwards (faults off, clients stopped, 15 s to settle) it prints: serve's RSS and /health
latency per minute (n, p50, p99, max), the in-flight gauges and the emulators' running requests
(drift: must be 0), what clients saw by cause, the normal clients' failures by the fault window
they overlapped (its length plus 6 s after), specroute's own counters, what the rogue did, the
decision log's lines (each must be whole JSON), and whether serve's stderr or any body a client
read holds the admin token or a backend's address; for issue 37: the numbers each backend
reported that were not taken, the tracebacks in serve's stderr (must be 0) and the decision-log
records dropped while it was stalled (`queue_full`).

    python benchmarks/soak.py [--minutes 10] [--normal 16]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from slow_reader import attacker

from controller.bench.server_state import metric_values, sglang_load
from controller.cli import spawn
from policies.routing import CLIENT_STALL_SHARE
from policies.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
PROFILE = "kimi-k25-int4-8gpu"
CHAT = [{"role": "user", "content": "Write a short note about queues."}]
ADMIN_TOKEN = "soak-admin-9d2f7c41e8b3"
GRACE_S = 6.0


# --- the backend child --------------------------------------------------------------------


def run_backend(mode: str, time_scale: float, seed: int) -> None:
    """One emulator; stdin lines `name=json` set its fault knobs (`clear` resets them)."""
    from policies.profile import resolve_profile
    from simulator.emulator.app import EmulatorConfig, run_emulator
    from simulator.emulator.config import FaultConfig

    async def main() -> None:
        config = EmulatorConfig(mode=mode, profile=resolve_profile(PROFILE), time_scale=time_scale, seed=seed)  # type: ignore[arg-type]
        async with run_emulator(config) as server:
            print(f"listening on {server.url}", flush=True)
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader()
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
            while line := (await reader.readline()).decode().strip():
                if line == "clear":
                    for name, field in FaultConfig.model_fields.items():
                        setattr(server.faults, name, field.default)
                else:
                    name, _, value = line.partition("=")
                    setattr(server.faults, name, json.loads(value))

    asyncio.run(main())


class Backend:
    def __init__(self, mode: str, time_scale: float, seed: int) -> None:
        cmd = [sys.executable, str(HERE / "soak.py"), "--role", "backend", "--mode", mode,
               "--time-scale", str(time_scale), "--seed", str(seed)]  # fmt: skip
        self.proc, line = spawn.start_sync(cmd, stdin=subprocess.PIPE, stderr=None, cwd=str(ROOT))
        self.url = spawn.url_of(line)
        self.mode = mode

    def fault(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def freeze(self, frozen: bool) -> None:
        self.proc.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)


# --- clients ------------------------------------------------------------------------------


SEEN: list[bytes] = []
"""Error bodies and error events clients read (row N: none may name a backend)."""
NAMED: list[str] = []
"""Answers that carried x-specroute-backend (row N: none may)."""


class Tally:
    def __init__(self) -> None:
        self.by_kind: dict[str, Counter[str]] = {}
        self.timed: dict[str, list[tuple[float, float, str]]] = {}
        """The normal and slow clients' requests: (start, end, outcome) on time.monotonic()."""

    def add(self, kind: str, outcome: str) -> None:
        self.by_kind.setdefault(kind, Counter())[outcome] += 1


def _error_code(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        err = body.get("error", body)
        return str(err.get("code") or err.get("type") or "?")
    except (ValueError, AttributeError):
        return "?"


async def _stream_outcome(r: aiohttp.ClientResponse, pace: float = 0.0, chunk: int = 0) -> str:
    data = b""
    if chunk:
        while part := await r.content.read(chunk):
            data += part
            await asyncio.sleep(pace)
    else:
        data = await r.read()
    # events end with a blank line in any of SSE's framings (LF, CRLF, CR): row G relays CRLF
    lf = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    events = [e.removeprefix(b"data: ") for e in lf.split(b"\n\n") if e.strip()]
    for e in events:
        if e.startswith(b'{"error"'):
            SEEN.append(e)
            return f"stream error {_error_code(e)}"
    return "ok" if events and events[-1] == b"[DONE]" else "stream ended without [DONE]"


async def one_request(s: aiohttp.ClientSession, url: str, rng: random.Random, **how: Any) -> str:
    chat = how.get("stream") or rng.random() < 0.7
    # Streamed /v1/completions are left out: the emulator truncates them when its process is
    # descheduled for 25 ms or more (issue 15), which would be counted here as specroute's errors.
    stream = how.get("stream", chat and rng.random() < 0.8)
    body: dict[str, Any] = {
        "model": "m",
        "stream": stream,
        "max_tokens": how.get("max_tokens", rng.randint(8, 200)),
    }
    if chat:
        body["messages"] = CHAT
    else:
        body["prompt"] = "Once upon a time"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with s.post(url + path, json=body) as r:
            if "x-specroute-backend" in r.headers:
                NAMED.append(r.headers["x-specroute-backend"])
            if r.status != 200:
                raw = await r.read()
                SEEN.append(raw)
                return f"HTTP {r.status} {_error_code(raw)}"
            if not stream:
                await r.read()
                return "ok"
            if "vanish_after" in how:  # (events of any size and framing: rows H and G)
                ends = 0
                while ends < how["vanish_after"] and (part := await r.content.readany()):
                    ends += part.count(b"\n\n") + part.count(b"\r\n\r\n")
                r.close()
                return "disconnected (on purpose)"
            return await _stream_outcome(r, how.get("pace", 0.0), how.get("chunk", 0))
    except aiohttp.ClientError as e:
        return f"client {type(e).__name__}"
    except TimeoutError:
        return "client timeout"


async def loop_clients(kind: str, n: int, url: str, end: float, tally: Tally, **how: Any) -> None:
    async def worker(i: int) -> None:
        rng = random.Random(hash((kind, i)))
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            while time.monotonic() < end:
                extra = dict(how)
                if kind == "disconnectors":
                    extra = {"stream": True, "max_tokens": 2000, "vanish_after": rng.randint(1, 3)}
                began = time.monotonic()
                outcome = await one_request(s, url, rng, **extra)
                tally.add(kind, outcome)
                if kind in ("normal", "slow"):
                    tally.timed.setdefault(kind, []).append((began, time.monotonic(), outcome))

    await asyncio.gather(*(worker(i) for i in range(n)))


async def stoppers(n: int, url: str, end: float, tally: Tally) -> None:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "m", "messages": CHAT, "stream": True, "max_tokens": 4000}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    loop = asyncio.get_running_loop()

    async def worker() -> None:
        while time.monotonic() < end:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, (host, int(port)))
                await loop.sock_sendall(sock, request)
                await loop.sock_recv(sock, 1024)  # the head and the first event
                await asyncio.sleep(20)  # then nothing
                tally.add("stoppers", "stopped reading (on purpose)")
            except OSError as e:
                tally.add("stoppers", f"client {type(e).__name__}")
            finally:
                sock.close()

    await asyncio.gather(*(worker() for _ in range(n)))


async def hostile(url: str, end: float, tally: Tally) -> None:
    bomb = b'{"messages": [], "x": [' + b"[]," * ((4 << 20) // 3) + b"[]]}"
    prose = json.dumps(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "a " * (15 << 20)}]}
    )
    large = prose.encode()
    inflating = gzip.compress(large, 9)
    host, port = url.removeprefix("http://").split(":")
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            for kind, data, headers in (
                ("large body", large, {}),
                ("gzip body", inflating, {"Content-Encoding": "gzip"}),
            ):
                try:
                    async with s.post(url + "/v1/chat/completions", data=data, headers=headers) as r:
                        tally.add("hostile", f"{kind}: HTTP {r.status} {_error_code(await r.read())}")
                except aiohttp.ClientError as e:
                    tally.add("hostile", f"{kind}: client {type(e).__name__}")
            try:
                async with s.post(url + "/v1/chat/completions", data=bomb) as r:
                    tally.add("hostile", f"HTTP {r.status} {_error_code(await r.read())}")
            except aiohttp.ClientError as e:
                tally.add("hostile", f"client {type(e).__name__}")
            for kind, path, payload in (
                (
                    "n 300",
                    "/v1/chat/completions",
                    {"model": "m", "messages": CHAT, "n": 300, "max_tokens": 8},
                ),
                ("300 prompts", "/v1/completions", {"model": "m", "prompt": ["Once"] * 300, "max_tokens": 8}),
                ("n 2", "/v1/chat/completions", {"model": "m", "messages": CHAT, "n": 2, "max_tokens": 8}),
            ):
                try:
                    async with s.post(url + path, json=payload) as r:
                        tally.add("hostile", f"{kind}: HTTP {r.status} {_error_code(await r.read())}")
                except aiohttp.ClientError as e:
                    tally.add("hostile", f"{kind}: client {type(e).__name__}")
            reader, writer = await asyncio.open_connection(host, int(port))
            body = json.dumps({"model": "m", "messages": CHAT}).encode()
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Note: caf\xe9\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
            answer = await reader.read()
            writer.close()
            tally.add("hostile", "HTTP " + answer.split(b" ", 2)[1].decode() + " (non-UTF-8 header)")
            await asyncio.sleep(2.0)


async def slow_readers(n: int, url: str, end: float, tally: Tally) -> None:
    """Issue 37's finding 1: `slow_reader.py`'s attacker, in closed loop."""

    async def worker(i: int) -> None:
        while time.monotonic() < end:
            try:
                tally.add("slow readers", await attacker(url, True, i))
            except (OSError, asyncio.IncompleteReadError) as e:
                tally.add("slow readers", f"client {type(e).__name__}")
            i += n

    await asyncio.gather(*(worker(i) for i in range(n)))


async def infos(url: str, end: float, tally: Tally) -> None:
    """Every second, 4 GETs at once of each info route (issue 37's finding 4)."""

    async def get(s: aiohttp.ClientSession, path: str) -> None:
        try:
            async with s.get(url + path) as r:
                raw = await r.read()
                code = "" if r.status == 200 else " " + _error_code(raw)
                tally.add("info", f"{path}: HTTP {r.status}{code}")
        except aiohttp.ClientError as e:
            tally.add("info", f"{path}: client {type(e).__name__}")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        while time.monotonic() < end:
            paths = ("/server_info", "/model_info", "/v1/models")
            await asyncio.gather(*(get(s, p) for p in paths for _ in range(4)))
            await asyncio.sleep(1.0)


class Rogue:
    """The rogue baseline backend (`rogue_backend.py`) relaying to `upstream`; modes via stdin."""

    def __init__(self, upstream: str) -> None:
        cmd = [sys.executable, str(HERE / "rogue_backend.py"), "--upstream", upstream]
        self.proc, line = spawn.start_sync(cmd, stdin=subprocess.PIPE, stderr=None, cwd=str(ROOT))
        self.url = spawn.url_of(line)
        self.mode = "rogue"

    def fault(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()


@dataclass
class Ops:
    """What the operations events act on: serve's pid, its config file and decision log."""

    pid: int
    config: Path
    decisions: Path
    text: str


def operate(ops: Ops, action: str) -> None:
    if action == "rotate":  # logrotate's create mode: move the file away, then SIGHUP
        n = len(list(ops.decisions.parent.glob(ops.decisions.name + ".*")))
        if ops.decisions.exists():
            ops.decisions.rename(ops.decisions.with_name(f"{ops.decisions.name}.{n + 1}"))
        os.kill(ops.pid, signal.SIGHUP)
    elif action == "remove":
        ops.decisions.unlink(missing_ok=True)
    elif action == "stall":  # issue 37: a hung mount: the log's path becomes a FIFO nobody reads
        n = len(list(ops.decisions.parent.glob(ops.decisions.name + ".*")))
        if ops.decisions.exists():
            ops.decisions.rename(ops.decisions.with_name(f"{ops.decisions.name}.{n + 1}"))
        os.mkfifo(ops.decisions)
        os.kill(ops.pid, signal.SIGHUP)  # the writer's open() waits for a reader that does not come
    elif action == "unstall":  # read the FIFO out into a file, then put a file at the path again
        out = ops.decisions.with_name(f"{ops.decisions.name}.fifo-{time.monotonic_ns()}")
        threading.Thread(target=_drain_fifo, args=(ops.decisions, out), daemon=True).start()
        time.sleep(0.5)
        ops.decisions.unlink()
        os.kill(ops.pid, signal.SIGHUP)  # serve opens a file at the path and closes the FIFO: EOF
    elif action == "half":  # row E: SIGHUP while the file is half written (cut inside the token's line)
        cut = ops.text.index("admin_token:") + len("admin_token: ") + 4
        ops.config.write_text(ops.text[:cut])
        os.kill(ops.pid, signal.SIGHUP)


def _drain_fifo(fifo: Path, out: Path) -> None:
    with open(fifo, "rb") as src, open(out, "wb") as dst:
        while chunk := src.read(1 << 16):
            dst.write(chunk)


Window = tuple[float, float, str]
"""A fault window: start and end on time.monotonic(), and what it was."""


async def faults(
    base: Backend, eagle: Backend, rogue: Rogue, ops: Ops, end: float, log: list[Window]
) -> None:
    """Repeat every 180 s: (second, backend or None for an operation, action, seconds)."""
    schedule: list[tuple[int, Backend | Rogue | None, str, float]] = [
        (0, eagle, "error_rate=1.0", 5),
        (10, base, "stall_s=8.0", 5),
        (20, eagle, "SIGSTOP", 6),
        (30, base, "die_after_chunks=3", 5),
        (40, eagle, "refuse_connections=true", 4),
        (50, base, "unhealthy=true", 5),
        # N before A: after A's oversized answers the rogue's /metrics is asked again only a minute later
        *((60 + 10 * i, rogue, f"mode={m}", 5) for i, m in enumerate("KBNICGHMJAS")),
        (5, None, "rotate", 0),
        (45, None, "half", 0.5),
        (95, None, "remove", 0),
        (168, None, "stall", 8),
    ]
    schedule.sort(key=lambda row: row[0])
    cycle_s = 180
    start = time.monotonic()
    cycle = 0
    while True:
        for at, backend, action, length in schedule:
            when = start + cycle * cycle_s + at
            if when + length > end:
                return
            await asyncio.sleep(max(0.0, when - time.monotonic()))
            began = time.monotonic()
            if backend is None:
                operate(ops, action)
                await asyncio.sleep(length)
                if action == "half":
                    ops.config.write_text(ops.text)  # the rest of the file
                if action == "stall":
                    operate(ops, "unstall")
                log.append((began, time.monotonic(), f"ops: {action}"))
                continue
            if action == "SIGSTOP":
                assert isinstance(backend, Backend)
                backend.freeze(True)
                await asyncio.sleep(length)
                backend.freeze(False)
            else:
                backend.fault(action)
                await asyncio.sleep(length)
                backend.fault("mode=" if backend is rogue else "clear")
            log.append((began, time.monotonic(), f"{backend.mode}: {action}"))
        cycle += 1


# --- reading the results ------------------------------------------------------------------


async def soak(
    args: argparse.Namespace, url: str, base: Backend, eagle: Backend, rogue: Rogue, ops: Ops
) -> tuple[Tally, list[Window]]:
    tally = Tally()
    log: list[Window] = []
    end = time.monotonic() + args.minutes * 60
    await asyncio.gather(
        loop_clients("normal", args.normal, url, end, tally),
        loop_clients("slow", 3, url, end, tally, stream=True, max_tokens=400, pace=0.05, chunk=512),
        loop_clients("disconnectors", 3, url, end, tally),
        stoppers(2, url, end, tally),
        slow_readers(2, url, end, tally),
        hostile(url, end, tally),
        infos(url, end, tally),
        faults(base, eagle, rogue, ops, end, log),
    )
    return tally, log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--normal", type=int, default=16, help="Closed-loop well-behaved clients.")
    ap.add_argument("--time-scale", type=float, default=0.25, help="Emulators' wall s per profile s.")
    ap.add_argument("--role", choices=["backend"], help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "backend":
        run_backend(args.mode, args.time_scale, args.seed)
        return 0

    procs: list[subprocess.Popen[str]] = []
    out = f"/tmp/specroute-soak-{os.getpid()}.txt"
    work = Path(tempfile.mkdtemp(prefix="specroute-soak-"))
    base = Backend("baseline", args.time_scale, 1)
    eagle = Backend("eagle", args.time_scale, 2)
    procs += [base.proc, eagle.proc]
    rogue = Rogue(base.url)
    procs.append(rogue.proc)
    decisions = work / "decisions.jsonl"
    text = (
        f"baseline: rogue={rogue.url},baseline={base.url}\neagle: eagle={eagle.url}\n"
        f"admin_token: {ADMIN_TOKEN}\nbackend_header: false\ndecision_log: {decisions}\n"
        "decision_log_queue_bytes: 262144\n"  # small, so the stalled log (issue 37) overflows it
    )
    config = work / "specroute.yaml"
    config.write_text(text)
    stderr_path = work / "serve.stderr"
    try:
        with stderr_path.open("w") as stderr:
            serve, line = spawn.start_sync(
                [sys.executable, "-m", "controller.cli", "serve", "--port", "0", "--config", str(config),
                 "--policy", "cost_model", "--profile", PROFILE, "--log-level", "WARNING",
                 "--first-byte-timeout-s", "5", "--idle-timeout-s", "5", "--client-write-timeout-s", "5",
                 "--connect-timeout-s", "1", "--health-check-interval-s", "1",
                 "--health-check-timeout-s", "1", "--outlier-base-ejection-s", "5",
                 "--eagle-backend-max-in-flight", "10", "--baseline-backend-max-in-flight", "32",
                 "--admission-wait-s", "2", "--request-timeout-s", "60"],
                stderr=stderr, cwd=str(ROOT),
            )  # fmt: skip
        procs.append(serve)
        url = spawn.url_of(line)
        probe, _ = spawn.start_sync(
            [sys.executable, str(HERE / "hostile_bodies.py"), "--role", "probe", "--url", url,
             "--pid", str(serve.pid), "--out", out],
            marker="ready", stderr=None, cwd=str(ROOT),
        )  # fmt: skip
        procs.append(probe)
        started = time.monotonic()
        ops = Ops(serve.pid, config, decisions, text)
        tally, log = asyncio.run(soak(args, url, base, eagle, rogue, ops))
        base.fault("clear")
        eagle.fault("clear")
        rogue.fault("mode=")
        time.sleep(15)  # faults off, clients gone: everything must drain to zero
        final = asyncio.run(metric_values(url))
        busy = {b.mode: asyncio.run(sglang_load(b.url)) for b in (base, eagle)}
        rogue_stats = asyncio.run(json_of(rogue.url + "/_rogue/stats"))
        hwm = Path(f"/proc/{serve.pid}/status").read_text()
        hwm_kib = int(next(line.split()[1] for line in hwm.splitlines() if line.startswith("VmHWM:")))
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    rows = [tuple(float(x) for x in row.split()) for row in Path(out).read_text().splitlines() if row]
    os.unlink(out)
    report(args, started, rows, tally, log, final, busy, hwm_kib)
    report_rows(tally, log, rogue_stats, work, [base.url, eagle.url, rogue.url])
    return 0


async def json_of(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.json()


def attribute(timed: list[tuple[float, float, str]], log: list[Window]) -> Counter[str]:
    """The normal clients' failures by the fault window they overlapped (the window's length plus
    `GRACE_S` after it: a timeout or an ejection that began in it), the latest such fault first;
    operations only when no fault overlaps; else "outside any window"."""
    out: Counter[str] = Counter()
    for began, ended, outcome in timed:
        if outcome == "ok":
            continue
        hits = [w for w in log if began <= w[1] + GRACE_S and ended >= w[0]]
        faults_ = [w for w in hits if not w[2].startswith("ops:")] or hits
        label = max(faults_, key=lambda w: w[0])[2] if faults_ else "outside any window"
        out[f"{label}: {outcome}"] += 1
    return out


def report_rows(
    tally: Tally, log: list[Window], rogue_stats: dict[str, int], work: Path, urls: list[str]
) -> None:
    for kind, timed in tally.timed.items():
        print(f"\n{kind} clients' failures by fault window (its length + {GRACE_S:g} s):")
        for what, n in sorted(attribute(timed, log).items(), key=lambda kv: -kv[1]):
            print(f"  {n:6d}  {what}")
    print("\nthe rogue backend did:", dict(sorted(rogue_stats.items())))
    lines = whole = stalled = 0
    files = sorted(work.glob("decisions.jsonl*"))
    for f in files:
        for line in f.read_bytes().splitlines():
            lines += 1
            try:
                record = json.loads(line)
                whole += 1
            except ValueError:
                continue
            blocked = record.get("client_blocked_s") or 0.0
            stalled += record["status"] == "ok" and blocked > CLIENT_STALL_SHARE * record["duration_s"]
    print(
        f"decision log (row F): {len(files)} files, {lines} lines, {lines - whole} not whole JSON "
        f"(must be 0); {stalled} ok answers whose client held the relay up (issue 37: they taught nothing)"
    )
    stderr = (work / "serve.stderr").read_text(errors="replace")
    print(
        f"serve's stderr (row D): {len(stderr.splitlines())} lines, admin token in it: "
        f"{ADMIN_TOKEN in stderr} (must be False); tracebacks in it (issue 37): "
        f"{stderr.count('Traceback')} (must be 0)"
    )
    named = [b for b in SEEN if any(u.encode() in b or u.removeprefix("http://").encode() in b for u in urls)]
    named += [b for b in SEEN if any(n in b for n in (b'"baseline"', b"rogue"))]
    print(
        f"row N: {len(SEEN)} error bodies/events read, {len(named)} naming a backend, "
        f"{len(NAMED)} answers with x-specroute-backend (all must be 0)"
    )
    shutil.rmtree(work, ignore_errors=True)


def report(
    args: argparse.Namespace,
    started: float,
    rows: list[tuple[float, ...]],
    tally: Tally,
    log: list[Window],
    final: dict[tuple[str, tuple[tuple[str, str], ...]], float],
    busy: dict[str, int],
    hwm_kib: int,
) -> None:
    print(f"\nsoak: {args.minutes:g} min, {args.normal} normal clients + slow/stoppers/disconnectors/hostile")
    print("faults (first cycle):")
    for began, ended, what in log[:18]:
        print(f"    {began - started:6.1f} s  {what} for {ended - began:.1f} s")
    print(f"   ... {len(log)} fault windows in all")
    print("\nminute  /health n   p50 ms   p99 ms   max ms   RSS MiB min/max")
    minutes = int(args.minutes + 0.999)
    for m in range(minutes + 1):
        inside = [r for r in rows if started + 60 * m <= r[0] < started + 60 * (m + 1)]
        if not inside:
            continue
        lat = [r[1] for r in inside]
        rss = [r[2] / 1024 for r in inside]
        label = f"{m:6d}" if m < minutes else " after"
        print(
            f"{label}  {len(lat):9d} {statistics.median(lat):8.1f} {percentile(lat, 99):8.1f} {max(lat):8.1f}"
            f"   {min(rss):6.0f} / {max(rss):4.0f}"
        )
    during = [r[1] for r in rows if started <= r[0] < started + args.minutes * 60]
    p50, p99 = statistics.median(during), percentile(during, 99)
    print(
        f"whole run: /health n={len(during)} p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {max(during):.1f} ms; "
        f"serve VmHWM {hwm_kib / 1024:.0f} MiB"
    )
    in_flight = {dict(k[1])["backend"]: v for k, v in final.items() if k[0] == "specroute_in_flight_requests"}
    print(f"\nin-flight after settling (drift, must be 0): {in_flight}; emulators running+waiting: {busy}")
    print("\nwhat clients saw:")
    for kind, counts in tally.by_kind.items():
        total = sum(counts.values())
        print(f"  {kind} (n={total}):")
        for outcome, n in counts.most_common():
            print(f"    {n:7d}  {100 * n / total:5.1f}%  {outcome}")

    def summed(name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (metric, labels), value in final.items():
            if metric == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + value
        return out

    print("\nspecroute's counters:")
    print("  requests by status:", summed("specroute_requests_total", "status"))
    print("  rejected by code:  ", summed("specroute_rejected_requests_total", "code"))
    print("  failovers by pool: ", summed("specroute_failovers_total", "pool"))
    print("  ejections:         ", summed("specroute_backend_ejections_total", "backend"))
    print("  client write timeouts:", summed("specroute_client_write_timeouts_total", ""))
    print("  config reloads by result (row E):", summed("specroute_config_reloads_total", "result"))
    print(
        "  decision-log records dropped (row F; queue_full: while stalled, issue 37):",
        summed("specroute_decision_log_dropped_records_total", "reason"),
    )
    print(
        "  numbers backends reported that were not taken (issue 37):",
        summed("specroute_backend_rejected_values_total", "backend"),
    )
    print("  admission waits / rejections:", summed("specroute_admission_waits_total", ""),
          summed("specroute_admission_rejections_total", ""))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
