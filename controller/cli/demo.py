"""`specroute demo`: the whole loop on one machine, no GPU and no arguments needed.

How it works: starts an emulated plain SGLang server and an emulated EAGLE-3 server
(`specroute emulate`, from the kimi profile) and the proxy (`specroute serve` with the
`cost_model` policy) as child processes, then drives a closed-loop concurrency sweep three
ways: straight to the plain server, straight to the EAGLE-3 server, and through specroute.
It prints one table (per concurrency: per-request decode tok/s and total tok/s of each way,
and how often specroute chose each pool) and writes the same as a PNG when matplotlib is
installed. Children are stopped on exit, on error and on Ctrl-C (and die with the demo on
Linux even if it is killed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from controller.bench.result import LevelSummary
from controller.bench.runner import run_sweep
from controller.cli.args import CommandError, bounded, positive_float, positive_int, run_async
from policies.base import POOLS, Pool
from policies.profile import ProfileError, resolve_profile
from policies.registry import default_registry
from policies.spec import PolicyError

DEFAULT_PROFILE = "kimi-k25-int4-8gpu"
DEFAULT_LEVELS = (1, 2, 5, 10, 30, 70)
QUICK_LEVELS = (1, 10)
WAYS = ("baseline", "eagle", "specroute")
NO_MATPLOTLIB = "matplotlib is not installed (pip install 'specroute[plot]'): no plot written"


class DemoError(RuntimeError):
    pass


@dataclass
class Row:
    concurrency: int
    summaries: dict[str, LevelSummary] = field(default_factory=dict)
    chosen: dict[Pool, int] = field(default_factory=dict)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the child gets SIGTERM when the demo dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Children:
    """Child processes started with a readiness line; all are stopped on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, asyncio.subprocess.Process]] = []
        self._drains: list[asyncio.Task[None]] = []
        self._logs: list[Any] = []

    async def start(self, name: str, args: Sequence[str], marker: str, timeout_s: float = 60.0) -> str:
        """Run `specroute ARGS`; return the URL at the end of its first line containing `marker`."""
        log = _open_log(self.log_dir / f"{name}.log")
        self._logs.append(log)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "controller.cli", *args,
            stdout=asyncio.subprocess.PIPE, stderr=log, stdin=asyncio.subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )  # fmt: skip
        self.procs.append((name, proc))
        assert proc.stdout is not None
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), timeout_s)).decode().strip()
        except TimeoutError:
            line = ""
        if marker not in line:
            await asyncio.sleep(0.2)
            tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
            raise DemoError(f"{name} did not start (first line {line!r}); its log ends:\n{tail}")
        self._drains.append(asyncio.create_task(_drain(proc.stdout, log)))
        return line.rsplit(" ", 1)[1]

    async def stop(self) -> None:
        for _, proc in self.procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for _, proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for t in self._drains:
            t.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        for log in self._logs:
            log.close()


def _open_log(path: Path) -> Any:
    return open(path, "wb")  # a small local file; closed by the drain task or Children.stop


async def _drain(stream: asyncio.StreamReader, log: Any) -> None:
    try:
        while chunk := await stream.read(65536):
            log.write(chunk)
    finally:
        log.close()


async def _wait_ready(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise DemoError(f"specroute at {url} did not become ready in {timeout_s:.0f} s")


async def _decisions(url: str) -> dict[Pool, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[Pool, float] = dict.fromkeys(POOLS, 0.0)
    for fam in text_string_to_metric_families(text):
        if fam.name == "specroute_decisions":
            for sample in fam.samples:
                pool = sample.labels.get("pool")
                if sample.name.endswith("_total") and pool in out:
                    out[pool] += sample.value
    return out


def _requests_for(c: int, quick: bool) -> int:
    return max(4 if quick else 8, c)


async def run_demo(args: argparse.Namespace) -> list[Row]:
    profile_name = args.profile
    resolve_profile(profile_name)  # a bad name fails here, before anything starts
    scale = args.time_scale
    levels: tuple[int, ...] = (
        tuple(args.levels) if args.levels else QUICK_LEVELS if args.quick else DEFAULT_LEVELS
    )
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    with tempfile.TemporaryDirectory(prefix="specroute-demo-") as tmp:
        kids = Children(Path(tmp))
        try:
            common = ["--profile", profile_name, "--port", "0", "--time-scale", str(scale)]
            base = await kids.start(
                "baseline emulator", ["emulate", "--mode", "baseline", *common], "listening"
            )
            eagle = await kids.start("eagle emulator", ["emulate", "--mode", "eagle", *common], "listening")
            print(f"emulated SGLang: plain on {base}, EAGLE-3 on {eagle} (time scale {scale})", flush=True)
            proxy = await kids.start(
                "specroute",
                ["serve", "--baseline", base, "--eagle", eagle, "--port", "0", "--policy", args.policy,
                 "--profile", profile_name, "--health-check-interval-s", "0.5", "--scrape-interval-s", "0.5"],
                "listening",
            )  # fmt: skip
            await _wait_ready(proxy)
            print(f"specroute ({args.policy}) on {proxy}", flush=True)
            print(header(scale), flush=True)
            rows: list[Row] = []
            for c in levels:
                row = Row(c)
                for way, url in zip(WAYS, (base, eagle, proxy), strict=True):
                    before = await _decisions(proxy) if way == "specroute" else None
                    result = await run_sweep(
                        url, levels=(c,), requests_per_level=_requests_for(c, args.quick), warmup=0,
                        max_tokens=max_tokens, ignore_eos=True, label=way, timeout_s=300,
                    )  # fmt: skip
                    row.summaries[way] = result.levels[0].summary
                    if before is not None:
                        after = await _decisions(proxy)
                        row.chosen = {p: round(after[p] - before[p]) for p in POOLS}
                rows.append(row)
                print(format_row(row, scale), flush=True)
                failed = {w: s.errors for w, s in row.summaries.items() if s.errors}
                if failed:
                    print(f"      note: failed requests at concurrency {c}: {failed}", flush=True)
            return rows
        finally:
            await kids.stop()


def _fmt_est(s: LevelSummary | None, attr: str, scale: float, ci: bool) -> str:
    est = getattr(s, attr, None) if s is not None else None
    if est is None:
        return "-"
    mean = est.mean * scale  # wall tok/s x time_scale = profile tok/s
    if ci and est.half_width is not None:
        return f"{mean:.1f}±{est.half_width * scale:.1f}"
    return f"{mean:.1f}"


def header(scale: float) -> str:
    note = "" if scale == 1.0 else f"  (emulators at --time-scale {scale}; rates rescaled to profile time)"
    top = f"{'':>10} | {'per-request decode tok/s (mean±95% CI)':^41} | {'total tok/s':^26} | "
    top += f"specroute chose{note}"
    cols = f"{'conc':>5}{'n':>5} | " + "".join(f"{w:>13} " for w in WAYS) + "| "
    cols += "".join(f"{w:>8} " for w in ("base", "eagle", "sproute")) + "| baseline  eagle"
    return top + "\n" + cols


def format_row(row: Row, scale: float) -> str:
    n = min((s.ok for s in row.summaries.values()), default=0)
    out = f"{row.concurrency:>5}{n:>5} | "
    out += "".join(f"{_fmt_est(row.summaries.get(w), 'decode_tok_s', scale, True):>13} " for w in WAYS)
    out += "| " + "".join(f"{_fmt_est(row.summaries.get(w), 'total_tok_s', scale, False):>8} " for w in WAYS)
    total = sum(row.chosen.values())
    if total:
        out += "| " + "  ".join(f"{100 * row.chosen.get(p, 0) / total:>6.0f}%" for p in POOLS)
    return out


def write_plot(rows: list[Row], scale: float, path: Path, title: str) -> str:
    """Write the PNG; returns a sentence for the user (also when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return NO_MATPLOTLIB
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [r.concurrency for r in rows]
    for ax, attr, label in zip(
        axes, ("decode_tok_s", "total_tok_s"), ("per-request decode tok/s", "total tok/s"), strict=True
    ):
        for way in WAYS:
            ys = []
            for r in rows:
                est = getattr(r.summaries.get(way), attr, None)
                ys.append(est.mean * scale if est is not None else float("nan"))
            ax.plot(xs, ys, marker="o", label=way)
        ax.set_xscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return f"plot written to {path.resolve()}"


def configure_demo(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[1] if __doc__ else None
    p.add_argument(
        "--quick", action="store_true", help="a shorter sweep (concurrency 1 and 10, fewer requests)"
    )
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"speed profile (default: {DEFAULT_PROFILE})")
    p.add_argument("--policy", default="cost_model", help="specroute policy (default: cost_model)")
    p.add_argument(
        "--levels",
        type=positive_int,
        nargs="+",
        help=f"concurrency levels (default: {' '.join(map(str, DEFAULT_LEVELS))})",
    )
    p.add_argument(
        "--max-tokens", type=bounded(int, ge=2), help="output tokens per request (default: 64; --quick: 32)"
    )
    p.add_argument(
        "--time-scale",
        type=positive_float,
        default=0.5,
        help="emulator time scale: wall seconds per profile second (default: 0.5, twice as fast)",
    )
    p.add_argument("--plot", default="specroute-demo.png", help="PNG to write (default: specroute-demo.png)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.set_defaults(func=run)


@dataclass
class _Stop:
    requested: bool = False


async def _main(args: argparse.Namespace, stop: _Stop) -> list[Row]:
    """`run_demo`; SIGINT and SIGTERM cancel it, and the cleanup in `run_demo` stops the children."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        stop.requested = True
        if task is not None:
            task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal)
    return await run_demo(args)


def _check_args(args: argparse.Namespace) -> None:
    """CommandError for anything that would fail later; a note when no plot can be written."""
    try:
        resolve_profile(args.profile)
        default_registry().get(args.policy)
    except (ProfileError, PolicyError) as e:
        raise CommandError(e) from None
    if not args.no_plot:
        folder = Path(args.plot).parent
        if not folder.is_dir():
            raise CommandError(f"--plot {args.plot}: {folder} is not an existing directory")
        if importlib.util.find_spec("matplotlib") is None:
            print(f"note: {NO_MATPLOTLIB}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    t0 = time.monotonic()
    stop = _Stop()
    try:
        rows = run_async(_main(args, stop))
    except (KeyboardInterrupt, asyncio.CancelledError, DemoError, aiohttp.ClientError, OSError) as e:
        # With Ctrl-C in a terminal the children get SIGINT too and may go first: whatever
        # error that causes here is part of the interruption.
        if stop.requested or isinstance(e, KeyboardInterrupt | asyncio.CancelledError):
            print("\nspecroute demo: interrupted; every process it started has been stopped", file=sys.stderr)
            return 130
        print(f"specroute demo: error: {e}", file=sys.stderr)
        return 1
    took = time.monotonic() - t0
    print(f"done in {took:.0f} s; n = measured requests per way and level; decode ± is a 95% t-interval")
    if not args.no_plot and rows:
        title = f"specroute demo ({resolve_profile(args.profile).name}; policy {args.policy})"
        try:
            print(write_plot(rows, args.time_scale, Path(args.plot), title))
        except OSError as e:
            print(f"specroute demo: error: cannot write the plot to {args.plot}: {e}", file=sys.stderr)
            return 1
    return 0
