"""`specroute demo`: where a pair of servers pays and where it does not, on one machine, no
GPU and no arguments needed.

How it works: for each profile (by default two: Llama-3.1-8B, whose EAGLE-3 is 2.4x faster than
plain for a lone stream, and Kimi-K2.5, whose EAGLE-3 is 3.7% faster alone and half as fast under
load) it starts emulated SGLang servers (`specroute emulate`) and three routers on the same
hardware, two servers each, as child processes: specroute (`specroute serve`, `cost_model`) over
one plain and one EAGLE-3 server, and a least-loaded router over two plain servers ("2x
baseline") and over two EAGLE-3 servers ("2x EAGLE-3") -- the alternatives an operator faces.
Each way has servers of its own, so no way's traffic or caches touch another's. It drives a
closed-loop concurrency sweep through the three, one after the other, and prints a table per
profile: per level and way the measured requests, per-request decode tok/s, TTFT, end-to-end
time (each with its 95% interval) and total tok/s; under each level specroute against both
alternatives on end-to-end time, and why specroute sent the share it did to EAGLE-3 (2x EAGLE-3
against 2x baseline at that load); `controller.cli.demo_report` words and judges them. A summary
under the tables says, from the same judgements, where the pair paid. While a level runs, a
progress line on stderr (a terminal). It writes the same figures as a PNG when matplotlib is
installed. Children are stopped after each profile, on exit, on error and on Ctrl-C (and die
with the demo on Linux even if it is killed).
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
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from controller.bench.runner import run_sweep
from controller.cli import spawn
from controller.cli.args import CommandError, bounded, positive_float, positive_int, run_async
from controller.cli.demo_report import (
    PAIR,
    TWO_EAGLE,
    TWO_PLAIN,
    WAYS,
    ActResult,
    Row,
    closing,
    column_titles,
    format_row,
    header,
    plot_figure,
    wrap_paragraphs,
)
from policies.base import POOLS, Pool
from policies.profile import ProfileError, resolve_profile
from policies.registry import default_registry
from policies.spec import PolicyError


@dataclass(frozen=True)
class Act:
    """One profile of the demo and the concurrency levels it is swept at."""

    profile: str
    levels: tuple[int, ...]
    quick_levels: tuple[int, ...]


ACTS = (
    Act("llama31-8b-h100-eagle3", (1, 4, 16), (1, 16)),
    Act("kimi-k25-int4-8gpu", (1, 10, 30), (1, 10)),
)
"""The default: a profile where the pair beats two plain servers, then one where it does not."""
PROFILE_LEVELS, PROFILE_QUICK_LEVELS = (1, 2, 5, 10, 30, 70), (1, 10)
"""--profile: one profile, swept at these levels (--quick: those)."""
REQUESTS, QUICK_REQUESTS = 12, 6
"""Measured requests per way and level (at least one per client): enough to resolve the
differences the default profiles show (at least 5% on end-to-end time) on a busy machine."""
DEFAULT_MAX_TOKENS, QUICK_MAX_TOKENS = 128, 64
"""Answers long enough that decode speed, not only TTFT, shapes the end-to-end time."""
NO_MATPLOTLIB = "matplotlib is not installed (pip install 'specroute[plot]'): no plot written"


class DemoError(RuntimeError):
    pass


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
    return max(QUICK_REQUESTS if quick else REQUESTS, c)


def acts_for(args: argparse.Namespace) -> list[Act]:
    """The profiles to run (--profile: that one alone) with their levels (--levels: for each)."""
    acts = list(ACTS) if args.profile is None else [Act(args.profile, PROFILE_LEVELS, PROFILE_QUICK_LEVELS)]
    if args.levels:
        return [Act(a.profile, tuple(args.levels), tuple(args.levels)) for a in acts]
    return acts


async def _start_servers(kids: Children, profile: str, args: argparse.Namespace) -> dict[str, str]:
    """Start one profile's emulators and the three routers; the URL of each way."""
    common = ["--profile", profile, "--port", "0", "--time-scale", str(args.time_scale)]
    modes = ("baseline", "eagle", "baseline", "baseline", "eagle", "eagle")
    plain, eagle, plain2a, plain2b, eagle2a, eagle2b = await asyncio.gather(
        *(
            kids.start(f"{mode} emulator {i}", ["emulate", "--mode", mode, *common], "listening")
            for i, mode in enumerate(modes)
        )
    )
    # Quick probes and scrapes; and no shutdown grace: no balancer polls the demo's /ready, so
    # the 5 s of `shutdown_grace_s` would only hold the demo's exit up.
    fast = ["--port", "0", "--health-check-interval-s", "0.5", "--scrape-interval-s", "0.5"]
    fast += ["--shutdown-grace-s", "0"]
    specroute = ["serve", "--baseline", plain, "--eagle", eagle, "--policy", args.policy]
    specroute += ["--profile", profile]
    two_plain = ["serve", "--baseline", f"{plain2a},{plain2b}", "--policy", "fixed", "--policy-param"]
    two_eagle = ["serve", "--eagle", f"{eagle2a},{eagle2b}", "--policy", "fixed", "--policy-param"]
    proxy, pair, eagles = await asyncio.gather(
        kids.start("specroute", [*specroute, *fast], "listening"),
        kids.start("2x baseline router", [*two_plain, "pool=baseline", *fast], "listening"),
        kids.start("2x EAGLE-3 router", [*two_eagle, "pool=eagle", *fast], "listening"),
    )
    await asyncio.gather(_wait_ready(proxy), _wait_ready(pair), _wait_ready(eagles))
    print(f"specroute ({args.policy}): {proxy} over one plain and one EAGLE-3 server")
    print(f"  servers: plain {plain}, EAGLE-3 {eagle}")
    print(f"2x baseline: {pair} over two plain servers, least loaded first")
    print(f"  servers: plain {plain2a} and {plain2b}")
    print(f"2x EAGLE-3: {eagles} over two EAGLE-3 servers, least loaded first")
    print(f"  servers: EAGLE-3 {eagle2a} and {eagle2b}")
    sys.stdout.flush()
    return {PAIR: proxy, TWO_PLAIN: pair, TWO_EAGLE: eagles}


async def run_act(
    act: Act, args: argparse.Namespace, log_dir: Path, max_tokens: int, progress: bool
) -> ActResult:
    """Start one profile's servers, sweep the three ways level by level (printing each level as it
    ends), and stop the servers."""
    profile = resolve_profile(act.profile)
    result = ActResult(act.profile, profile.name)
    print(f"\n== {act.profile}: {profile.name} ==", flush=True)
    levels = act.quick_levels if args.quick else act.levels
    eagle_cap = profile.mode("eagle").max_running_requests
    folder = Path(tempfile.mkdtemp(prefix="profile-", dir=log_dir))  # --profile may be a path
    kids = Children(folder)
    try:
        urls = await _start_servers(kids, act.profile, args)
        print(column_titles(), flush=True)
        for c in levels:
            row = Row(c, eagle_cap=eagle_cap)
            for way in WAYS:
                before = await _decisions(urls[way]) if way == PAIR else None
                sweep = await run_sweep(
                    urls[way], levels=(c,), requests_per_level=_requests_for(c, args.quick), warmup=0,
                    max_tokens=max_tokens, ignore_eos=True, label=way, timeout_s=300, progress=progress,
                )  # fmt: skip
                row.summaries[way] = sweep.levels[0].summary
                if before is not None:
                    after = await _decisions(urls[way])
                    row.chosen = {p: round(after[p] - before[p]) for p in POOLS}
            result.rows.append(row)
            print(format_row(row, args.time_scale, max_tokens), flush=True)
            failed = {w: s.errors for w, s in row.summaries.items() if s.errors}
            if failed:
                print(f"      note: failed requests at concurrency {c}: {failed}", flush=True)
    finally:
        await kids.stop()
    return result


async def run_demo(args: argparse.Namespace) -> list[ActResult]:
    acts = acts_for(args)
    for act in acts:
        resolve_profile(act.profile)  # a bad name fails here, before anything starts
    max_tokens = args.max_tokens or (QUICK_MAX_TOKENS if args.quick else DEFAULT_MAX_TOKENS)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    print(header(args.time_scale, max_tokens), flush=True)
    results: list[ActResult] = []
    with tempfile.TemporaryDirectory(prefix="specroute-demo-") as tmp:
        for act in acts:
            results.append(await run_act(act, args, Path(tmp), max_tokens, progress))
    return results


def plot_title(args: argparse.Namespace) -> str:
    return (
        f"specroute demo on emulated SGLang servers: specroute ({args.policy}) against 2x baseline and "
        f"2x EAGLE-3, two servers each (emulator time scale {args.time_scale})"
    )


def write_plot(acts: list[ActResult], scale: float, path: Path, title: str) -> str:
    """Write the PNG; returns a sentence for the user (also when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return NO_MATPLOTLIB
    fig = plot_figure(acts, scale, title)
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return f"plot written to {path.resolve()}"


def configure_demo(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[1] if __doc__ else None
    p.add_argument(
        "--quick",
        action="store_true",
        help="a shorter sweep (two levels per profile, fewer requests, 64-token answers)",
    )
    p.add_argument(
        "--profile",
        help="run one speed profile (a built-in name or a JSON file) instead of the default two "
        f"({', '.join(a.profile for a in ACTS)}), at levels {' '.join(map(str, PROFILE_LEVELS))}",
    )
    p.add_argument("--policy", default="cost_model", help="specroute policy (default: cost_model)")
    p.add_argument(
        "--levels",
        type=positive_int,
        nargs="+",
        help="concurrency levels, for every profile (default: "
        + "; ".join(f"{a.profile} {' '.join(map(str, a.levels))}" for a in ACTS)
        + ")",
    )
    p.add_argument(
        "--max-tokens",
        type=bounded(int, ge=2),
        help=f"output tokens per request (default: {DEFAULT_MAX_TOKENS}; --quick: {QUICK_MAX_TOKENS})",
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


async def _main(args: argparse.Namespace, stop: _Stop) -> list[ActResult]:
    """`run_demo`; SIGINT and SIGTERM cancel it, and the cleanup in `run_act` stops the children."""
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
        for act in acts_for(args):
            profile = resolve_profile(act.profile)
            for pool in POOLS:
                profile.mode(pool)
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
        acts = run_async(_main(args, stop))
    except (KeyboardInterrupt, asyncio.CancelledError, DemoError, aiohttp.ClientError, OSError) as e:
        # With Ctrl-C in a terminal the children get SIGINT too and may go first: whatever
        # error that causes here is part of the interruption.
        if stop.requested or isinstance(e, KeyboardInterrupt | asyncio.CancelledError):
            print("\nspecroute demo: interrupted; every process it started has been stopped", file=sys.stderr)
            return 130
        print(f"specroute demo: error: {e}", file=sys.stderr)
        return 1
    took = time.monotonic() - t0
    print()
    for line in wrap_paragraphs(closing(acts)):
        print(line)
    print(f"done in {took:.0f} s; n = measured requests per way and level; ± is a 95% t-interval; the")
    print("verdicts are 95% Welch intervals of the difference (relative to the way compared with): a tie")
    print("when the interval contains 0 or the difference is under 1%; chose eagle: specroute's share of")
    print("requests sent to its EAGLE-3 server")
    if not args.no_plot and acts:
        try:
            print(write_plot(acts, args.time_scale, Path(args.plot), plot_title(args)))
        except OSError as e:
            print(f"specroute demo: error: cannot write the plot to {args.plot}: {e}", file=sys.stderr)
            return 1
    return 0
