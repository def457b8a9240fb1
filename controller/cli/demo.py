"""`specroute demo`: the whole loop on one machine, no GPU and no arguments needed.

How it works: starts two emulated plain SGLang servers and an emulated EAGLE-3 server
(`specroute emulate`, from the kimi profile), specroute (`specroute serve` with the
`cost_model` policy) over one plain and the EAGLE-3 server, and a second specroute that sends
everything to the two plain servers, least loaded first, as child processes. Then it drives a
closed-loop concurrency sweep four ways, one after the other: straight to one plain server,
straight to the EAGLE-3 server, through specroute (plain + EAGLE-3), and through the
least-loaded router over two plain servers ("2x baseline": the same hardware as specroute,
without speculation; the comparison an operator faces). It prints one table, a row per
concurrency: per-request decode tok/s of each way with its 95% interval, total tok/s of the two
two-server ways, specroute against 2x baseline as `specroute compare` judges it (faster,
slower, not distinguishable), and how often specroute chose the EAGLE-3 server; while a level
runs, a progress line on stderr (a terminal). It writes the same as a PNG when matplotlib is
installed. Children are stopped on exit, on error and on Ctrl-C (and die with the demo on Linux
even if it is killed).
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
from typing import Any, BinaryIO

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from controller.bench.compare import METRICS
from controller.bench.result import LevelSummary
from controller.bench.runner import run_sweep
from controller.cli import spawn
from controller.cli.args import CommandError, bounded, positive_float, positive_int, run_async
from policies.base import POOLS, Pool
from policies.profile import ProfileError, resolve_profile
from policies.registry import default_registry
from policies.spec import PolicyError
from policies.stats import verdict

DEFAULT_PROFILE = "kimi-k25-int4-8gpu"
DEFAULT_LEVELS = (1, 2, 5, 10, 30, 70)
QUICK_LEVELS = (1, 10)
WAYS = ("baseline", "eagle", "specroute", "2x baseline")
PAIR = ("specroute", "2x baseline")
"""The two ways on the same hardware (two servers each): the comparison that decides."""
DECODE = next(m for m in METRICS if m.title == "decode tok/s")
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
        self._logs: list[BinaryIO] = []

    async def start(self, name: str, args: Sequence[str], marker: str, timeout_s: float = 60.0) -> str:
        """Run `specroute ARGS`; the URL at the end of its first line containing `marker`
        (`controller.cli.spawn.read_listening`)."""
        log = _open_log(self.log_dir / f"{name}.log")
        self._logs.append(log)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "controller.cli", *args,
            stdout=asyncio.subprocess.PIPE, stderr=log, stdin=asyncio.subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )  # fmt: skip
        self.procs.append((name, proc))
        try:
            line = await spawn.read_listening(proc, marker=marker, timeout_s=timeout_s, what=name)
        except spawn.StartError as e:
            tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
            raise DemoError(f"{name} did not start ({e}); its log ends:\n{tail}") from None
        assert proc.stdout is not None
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


def _open_log(path: Path) -> BinaryIO:
    return open(path, "wb")  # a small local file; closed by the drain task or Children.stop


async def _drain(stream: asyncio.StreamReader, log: BinaryIO) -> None:
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


async def _start_servers(kids: Children, args: argparse.Namespace) -> dict[str, str]:
    """Start the emulators and the two routers; the URL of each way."""
    common = ["--profile", args.profile, "--port", "0", "--time-scale", str(args.time_scale)]
    base, base2, eagle = await asyncio.gather(
        kids.start("baseline emulator", ["emulate", "--mode", "baseline", *common], "listening"),
        kids.start("baseline emulator 2", ["emulate", "--mode", "baseline", *common], "listening"),
        kids.start("eagle emulator", ["emulate", "--mode", "eagle", *common], "listening"),
    )
    fast = ["--port", "0", "--health-check-interval-s", "0.5", "--scrape-interval-s", "0.5"]
    specroute = ["serve", "--baseline", base, "--eagle", eagle, "--policy", args.policy]
    two_plain = [
        "serve",
        "--baseline",
        f"{base},{base2}",
        "--policy",
        "fixed",
        "--policy-param",
        "pool=baseline",
    ]
    proxy, pair = await asyncio.gather(
        kids.start("specroute", [*specroute, "--profile", args.profile, *fast], "listening"),
        kids.start("2x baseline router", [*two_plain, *fast], "listening"),
    )
    await asyncio.gather(_wait_ready(proxy), _wait_ready(pair))
    print(f"emulated SGLang servers (time scale {args.time_scale}):", flush=True)
    print(f"  plain {base} and {base2}, EAGLE-3 {eagle}", flush=True)
    print(f"2x baseline: {pair} (both plain servers, least loaded first)", flush=True)
    print(f"specroute ({args.policy}) on {proxy} (one plain and the EAGLE-3 server)", flush=True)
    return {"baseline": base, "eagle": eagle, "specroute": proxy, "2x baseline": pair}


async def run_demo(args: argparse.Namespace) -> list[Row]:
    resolve_profile(args.profile)  # a bad name fails here, before anything starts
    scale = args.time_scale
    levels: tuple[int, ...] = (
        tuple(args.levels) if args.levels else QUICK_LEVELS if args.quick else DEFAULT_LEVELS
    )
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    with tempfile.TemporaryDirectory(prefix="specroute-demo-") as tmp:
        kids = Children(Path(tmp))
        try:
            urls = await _start_servers(kids, args)
            print(header(scale), flush=True)
            rows: list[Row] = []
            for c in levels:
                row = Row(c)
                for way in WAYS:
                    before = await _decisions(urls[way]) if way == "specroute" else None
                    result = await run_sweep(
                        urls[way], levels=(c,), requests_per_level=_requests_for(c, args.quick), warmup=0,
                        max_tokens=max_tokens, ignore_eos=True, label=way, timeout_s=300, progress=progress,
                    )  # fmt: skip
                    row.summaries[way] = result.levels[0].summary
                    if before is not None:
                        after = await _decisions(urls[way])
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
    return f"{mean:.0f}"


_DECODE_W, _TOTAL_W, _VERDICT_W = 12, 8, 19


def header(scale: float) -> str:
    """Column titles (at most 100 columns wide)."""
    lines = []
    if scale != 1.0:
        lines.append(f"emulators at --time-scale {scale}: tok/s below are rescaled to profile time")
    lines.append(
        " " * 8
        + f"{'per-request decode tok/s (mean ±95% CI)':^{4 * _DECODE_W}} "
        + f"{'total tok/s':^{2 * _TOTAL_W}} "
        + f"{'specroute vs':<{_VERDICT_W}} chose"
    )
    lines.append(
        f"{'conc':>4}{'n':>4}"
        + "".join(f"{w:>{_DECODE_W}}" for w in WAYS)
        + " "
        + "".join(f"{w:>{_TOTAL_W}}" for w in ("sproute", "2x base"))
        + " "
        + f"{'2x baseline':<{_VERDICT_W}} eagle"
    )
    return "\n".join(lines)


def specroute_verdict(row: Row) -> str:
    """specroute against 2x baseline on per-request decode tok/s, as `specroute compare` judges."""
    base, other = (row.summaries.get(w) for w in ("2x baseline", "specroute"))
    if base is None or other is None:
        return "-"
    return verdict(DECODE.get(base), DECODE.get(other), DECODE.higher_is_better)


def format_row(row: Row, scale: float) -> str:
    n = min((s.ok for s in row.summaries.values()), default=0)
    out = f"{row.concurrency:>4}{n:>4}"
    out += "".join(
        f"{_fmt_est(row.summaries.get(w), 'decode_tok_s', scale, True):>{_DECODE_W}}" for w in WAYS
    )
    out += " " + "".join(
        f"{_fmt_est(row.summaries.get(w), 'total_tok_s', scale, False):>{_TOTAL_W}}" for w in PAIR
    )
    out += f" {specroute_verdict(row):<{_VERDICT_W}}"
    total = sum(row.chosen.values())
    if total:
        out += f" {100 * row.chosen.get('eagle', 0) / total:>4.0f}%"
    return out.rstrip()


def plot_title(args: argparse.Namespace) -> str:
    return (
        f"specroute demo on emulated SGLang servers ({resolve_profile(args.profile).name}; "
        f"policy {args.policy}; emulator time scale {args.time_scale})"
    )


def write_plot(rows: list[Row], scale: float, path: Path, title: str) -> str:
    """Write the PNG; returns a sentence for the user (also when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return NO_MATPLOTLIB
    fig = plot_figure(rows, scale, title)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return f"plot written to {path.resolve()}"


def plot_figure(rows: list[Row], scale: float, title: str) -> Any:
    """The figure: per-request decode and total tok/s of every way, with 95% intervals."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    xs = [r.concurrency for r in rows]
    for ax, attr, label in zip(
        axes, ("decode_tok_s", "total_tok_s"), ("per-request decode tok/s", "total tok/s"), strict=True
    ):
        for way in WAYS:
            ys, errs = [], []
            for r in rows:
                est = getattr(r.summaries.get(way), attr, None)
                ys.append(est.mean * scale if est is not None else float("nan"))
                half = est.half_width if est is not None else None
                errs.append(half * scale if half is not None else 0.0)
            style = "--" if way == "2x baseline" else "-"
            ax.errorbar(xs, ys, yerr=errs, marker="o", linestyle=style, capsize=3, label=way)
        ax.set_xscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label + " (95% CI)")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


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
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress line on stderr while a level runs (default: when stderr is a terminal)",
    )
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
    print(f"done in {took:.0f} s; n = measured requests per way and level; ± is a 95% t-interval;")
    print("specroute vs 2x baseline: per-request decode tok/s as `specroute compare` judges it")
    print("(not distinguishable: the intervals overlap); chose eagle: specroute's share of requests")
    if not args.no_plot and rows:
        title = plot_title(args)
        try:
            print(write_plot(rows, args.time_scale, Path(args.plot), title))
        except OSError as e:
            print(f"specroute demo: error: cannot write the plot to {args.plot}: {e}", file=sys.stderr)
            return 1
    return 0
