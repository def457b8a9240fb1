"""Small helpers shared by the test modules (imported as `from helpers import ...`).

- Request bodies and profiles many modules use: `CHAT` (one user message), `BODY` (a streaming
  chat request of it), `WHOLE_BODY` (the same, not streamed), `FRANCE` (a question with a short
  factual answer) and `KIMI` (the built-in kimi-k25-int4-8gpu profile). Read them, never change
  them: they are shared by every test.
- `post_bytes(url, path, body)`: a JSON POST that must answer 200; the raw response bytes.
- `run_main(capsys, *args)`: `specroute ARGS` in this process; exit code, stdout and stderr.
- `wait_until(predicate)`: poll a plain or async predicate for a bounded time; its last value.
- `metric_samples(url, name)`: one metric's samples from a live `/metrics`, keyed by sorted labels.
- `emulator_running(url)`: requests an emulated SGLang server runs or queues (`/v1/loads`).
- `assert_in_flight_zero(url)`: every `specroute_in_flight_requests` sample on a proxy's `/metrics` is 0.
- `assert_openai_error(body, code)`: an OpenAI-shaped error body with that code and no traceback.
- `run_command(*args)` / `run_specroute(*args)`: a subprocess run to its end without blocking the loop.
- `start_module(module, *args)`: `python -m MODULE ARGS` started, its "listening on URL" line read
  (by `controller.cli.spawn`, the spawn helper the tests, the benchmarks and the demo share; its
  `start_sync`/`read_listening_sync` serve synchronous tests).
- `free_port()`, `raise_open_files_limit(n)`.
- `tiny_tmpfs(path)`: a 256 KiB tmpfs mounted at `path` for a `with` block (skips the test where
  mounting is not allowed); `fill_file_system(path, leave)`: fill it to its last bytes.
- `port_of(url)`, `raw_post(path, body)` (a POST's bytes) and `raw_exchange(port, data)`: raw HTTP
  for the tests that speak it broken.
- `Routed(policy, seed)`: a policy as the proxy and the simulator use it, every `choose` going
  through the routing core (`policies.routing.Router`); other attributes are the policy's.
- Prefix caches: `cache_profile(prefill_tok_s, cache_tokens)` (the kimi profile with a prefill
  rate and a cache size in every mode), `block_text(n_blocks, tag)` (text of exactly that many
  512-token index blocks, shared by no other tag) and `replay_conversation(client, system,
  users)` (a multi-turn chat through the official client: per turn TTFT, cached and prompt
  tokens as the usage reports them, and the serving pool/backend from specroute's headers).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from openai.types.chat import ChatCompletionMessageParam

from controller.bench.server_state import Labels, metric_values, sglang_load
from controller.cli import main, spawn
from controller.proxy.config import parse_backend
from controller.proxy.load import LoadTracker
from policies.base import Decision, LoadView, Outcome, Policy, RequestInfo
from policies.profile import Profile, parse_profile, resolve_profile
from policies.routing import Router

ROOT = Path(__file__).resolve().parent.parent

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
BODY: dict[str, Any] = {"model": "m", "messages": CHAT, "stream": True}
WHOLE_BODY: dict[str, Any] = {"model": "m", "messages": CHAT}
FRANCE: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
KIMI = resolve_profile("kimi-k25-int4-8gpu")  # prefill 8000 (baseline) / 7600 (eagle) tok/s


async def post_bytes(
    url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> bytes:
    """POST `body` as JSON to `url + path`; asserts 200 and returns the response's bytes unchanged."""
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, headers=headers) as r:
        assert r.status == 200
        return await r.read()


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`specroute ARGS` run in this process (`controller.cli.main`): exit code, stdout, stderr."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0, interval_s: float = 0.02
) -> bool:
    """Poll `predicate` (plain or async) until it holds or `timeout_s` has passed; returns its last
    value, so callers write `assert await wait_until(...)`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = predicate()
        ok = bool(await result) if inspect.isawaitable(result) else bool(result)
        if ok or loop.time() >= deadline:
            return ok
        await asyncio.sleep(interval_s)


async def metric_samples(url: str, name: str) -> dict[Labels, float]:
    """Samples of one metric from a `/metrics` endpoint, keyed by their sorted labels."""
    return {labels: value for (sample, labels), value in (await metric_values(url)).items() if sample == name}


async def emulator_running(url: str) -> int:
    """Requests an emulated SGLang server runs or queues, from its `/v1/loads`."""
    return await sglang_load(url)


async def assert_in_flight_zero(url: str, timeout_s: float = 10.0) -> None:
    """Every specroute_in_flight_requests sample on the proxy's /metrics is exactly 0 (client
    disconnects are noticed asynchronously, so poll for a bounded time)."""
    samples: dict[Labels, float] = {}

    async def all_zero() -> bool:
        nonlocal samples
        samples = await metric_samples(url, "specroute_in_flight_requests")
        assert samples, "no specroute_in_flight_requests samples"
        return all(v == 0.0 for v in samples.values())

    await wait_until(all_zero, timeout_s, interval_s=0.05)
    assert all(v == 0.0 for v in samples.values()), samples


def assert_openai_error(body: Any, code: str) -> None:
    """`body` is `{"error": {message, type, param, code}}` with this code, a message, no traceback;
    `param` is null or the name of the request field at fault."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == code and (err["param"] is None or isinstance(err["param"], str)), err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]


async def run_command(
    *args: str,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = ROOT,
    timeout_s: float = 120.0,
) -> tuple[int, str, str]:
    """Run a command to its end without blocking the loop; (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *args, cwd=cwd, env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else None), timeout_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def run_specroute(*args: str, **kw: Any) -> tuple[int, str, str]:
    """`specroute ARGS` (as `python -m controller.cli`) through `run_command`."""
    return await run_command(sys.executable, "-m", "controller.cli", *args, **kw)


async def start_module(
    module: str,
    *args: str,
    marker: str = spawn.MARKER,
    stderr: Any = asyncio.subprocess.PIPE,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], Any] | None = None,
    timeout_s: float = 30.0,
) -> tuple[asyncio.subprocess.Process, str]:
    """`python -m MODULE ARGS` started by the one spawn helper (`controller.cli.spawn.start`): the
    process and its listening line (stripped); `spawn.StartError` if it never says it listens."""
    return await spawn.start(
        [sys.executable, "-m", module, *args],
        marker=marker, stderr=stderr, stdin=None, env=env, preexec_fn=preexec_fn, timeout_s=timeout_s,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    """`app` served on 127.0.0.1 at a free port while the block runs; its base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (right now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_open_files_limit(needed: int) -> None:
    """Raise this process's soft open-files limit to `needed` (up to the hard limit), else skip."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        pytest.skip(f"open-files limit {soft} < {needed} and the hard limit does not allow more")


def peak_rss(pid: int) -> int:
    """A process's peak resident memory since it started (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def raw_post(path: str, body: bytes, extra: bytes = b"", content_length: int | None = None) -> bytes:
    """The bytes of `POST path` with a JSON `body`, `Connection: close` and `extra` header lines."""
    length = len(body) if content_length is None else content_length
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


async def raw_exchange(port: int, data: bytes, timeout_s: float = 10.0) -> bytes:
    """Send raw bytes to 127.0.0.1:`port`, read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


class Routed:
    """`policy` behind the routing core: `choose` is `Router(seed).decide(policy, ...)`."""

    def __init__(self, policy: Policy, seed: int = 0) -> None:
        self.policy = policy
        self.name = policy.name
        self.router = Router(seed)

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        return self.router.decide(self.policy, request, view, now)

    def observe(self, outcome: Outcome) -> None:
        self.policy.observe(outcome)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)


# -- prefix caches ------------------------------------------------------------------------------


def cache_profile(prefill_tok_s: float | None = None, cache_tokens: int | None = None) -> Profile:
    """The kimi profile with `prefill_tok_s` and `cache_tokens` set in every mode."""
    data: dict[str, Any] = resolve_profile("kimi-k25-int4-8gpu").model_dump(mode="json", exclude_none=True)
    for mode in data["modes"].values():
        if prefill_tok_s is not None:
            mode["prefill_tok_s"] = prefill_tok_s
        if cache_tokens is not None:
            mode["cache_tokens"] = cache_tokens
    return parse_profile(data)


def block_text(n_blocks: int, tag: str, block_chars: int = 2048) -> str:
    """Exactly `n_blocks` blocks of `block_chars` characters (the proxy's 512-token blocks by
    default) that text made from another tag never shares."""
    unit = f"{tag} " * (n_blocks * block_chars // (len(tag) + 1) + 1)
    return unit[: n_blocks * block_chars]


@dataclass(frozen=True)
class Turn:
    ttft_s: float
    cached_tokens: int
    """`usage.prompt_tokens_details.cached_tokens` (0 when the details are null)."""
    prompt_tokens: int
    pool: str | None
    backend: str | None


async def replay_conversation(
    client: Any, system: str, users: Sequence[str], *, max_tokens: int = 16, model: str = "m"
) -> list[Turn]:
    """A multi-turn chat, streamed with usage: every turn resends the whole conversation so far
    (the system prompt, earlier questions and the answers) plus the next user message."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    turns = []
    for user in users:
        messages.append({"role": "user", "content": user})
        began = time.perf_counter()
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        ttft = None
        usage = None
        text = []
        async for chunk in raw.parse():
            if chunk.choices:
                if ttft is None:
                    ttft = time.perf_counter() - began
                text.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        assert ttft is not None and usage is not None
        details = usage.prompt_tokens_details
        turns.append(
            Turn(
                ttft_s=ttft,
                cached_tokens=details.cached_tokens or 0 if details is not None else 0,
                prompt_tokens=usage.prompt_tokens,
                pool=raw.headers.get("x-specroute-pool"),
                backend=raw.headers.get("x-specroute-backend"),
            )
        )
        messages.append({"role": "assistant", "content": "".join(text)})
    return turns


@contextlib.contextmanager
def tiny_tmpfs(mnt: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs at `mnt` (created) while the block runs; the test is skipped where that
    needs rights it lacks (root and the right to mount)."""
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_file_system(path: Path, leave: int) -> None:
    """Fill the file system of `path` to the last `leave` bytes (rounded to its pages)."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        f.truncate(max(0, f.tell() - leave))


def make_tracker(baseline: Sequence[str], eagle: Sequence[str], **kw: Any) -> LoadTracker:
    """A `LoadTracker` of backends written as `URL` or `NAME=URL`, as the settings take them."""
    return LoadTracker(
        [parse_backend(b, "baseline") for b in baseline], [parse_backend(e, "eagle") for e in eagle], **kw
    )
