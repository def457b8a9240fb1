"""`specroute demo`: the whole loop on one machine, no GPU and no arguments needed.

How it works: starts two emulated plain SGLang servers and an emulated EAGLE-3 server
(`specroute emulate`, from the kimi profile), specroute (`specroute serve` with the
`cost_model` policy) over one plain and the EAGLE-3 server, and a second specroute that sends
everything to the two plain servers, least loaded first, as child processes. Then it drives a
closed-loop concurrency sweep four ways, one after the other: straight to one plain server,
straight to the EAGLE-3 server, through specroute (plain + EAGLE-3), and through the
least-loaded router over two plain servers ("2x baseline": the same hardware as specroute,
without speculation; the comparison an operator faces). It prints one table, a block per
concurrency with a row per way: measured requests, per-request decode tok/s, TTFT, end-to-end
time (each with its 95% interval) and total tok/s; under each block specroute against 2x
baseline on end-to-end time as `specroute compare` judges it (faster, slower, not
distinguishable, with the requests behind it), and why specroute chose the EAGLE-3 server as
often as it did (the EAGLE-3 server against the plain one at that concurrency: decode, TTFT,
end-to-end). A sentence under the table says what the comparison shows and where a pair would
win. While a level runs, a progress line on stderr (a terminal). It writes the same figures as a
PNG when matplotlib is installed, a panel per column. Children are stopped on exit, on error
and on Ctrl-C (and die with the demo on Linux even if it is killed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import signal
import sys
import tempfile
import textwrap
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
from policies.profile import Profile, ProfileError, resolve_profile
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
E2E = next(m for m in METRICS if m.title == "e2e s")
TTFT = next(m for m in METRICS if m.title == "TTFT s")
DEFAULT_MAX_TOKENS, QUICK_MAX_TOKENS = 128, 64
"""Answers long enough that decode speed, not only TTFT, shapes the end-to-end time."""
WIDTH = 100
NO_MATPLOTLIB = "matplotlib is not installed (pip install 'specroute[plot]'): no plot written"


class DemoError(RuntimeError):
    pass


@dataclass
class Row:
    concurrency: int
    summaries: dict[str, LevelSummary] = field(default_factory=dict)
    chosen: dict[Pool, int] = field(default_factory=dict)
    eagle_cap: int | None = None
    """The EAGLE-3 server's max_running_requests (from the profile), for the why line."""


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
    # Quick probes and scrapes; and no shutdown grace: no balancer polls the demo's /ready, so
    # the 5 s of `shutdown_grace_s` would only hold the demo's exit up.
    fast = ["--port", "0", "--health-check-interval-s", "0.5", "--scrape-interval-s", "0.5"]
    fast += ["--shutdown-grace-s", "0"]
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
    max_tokens = args.max_tokens or (QUICK_MAX_TOKENS if args.quick else DEFAULT_MAX_TOKENS)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    eagle_cap = resolve_profile(args.profile).mode("eagle").max_running_requests
    with tempfile.TemporaryDirectory(prefix="specroute-demo-") as tmp:
        kids = Children(Path(tmp))
        try:
            urls = await _start_servers(kids, args)
            print(header(scale, max_tokens), flush=True)
            rows: list[Row] = []
            for c in levels:
                row = Row(c, eagle_cap=eagle_cap)
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
                print(format_row(row, scale, max_tokens), flush=True)
                failed = {w: s.errors for w, s in row.summaries.items() if s.errors}
                if failed:
                    print(f"      note: failed requests at concurrency {c}: {failed}", flush=True)
            return rows
        finally:
            await kids.stop()


def _fmt_est(s: LevelSummary | None, attr: str, scale: float, ci: bool, digits: int = 1) -> str:
    """`mean±half` (or the mean alone) in profile time: tok/s times the time scale, seconds divided."""
    est = getattr(s, attr, None) if s is not None else None
    if est is None:
        return "-"
    f = scale if attr.endswith("tok_s") else 1.0 / scale
    if ci and est.half_width is not None:
        return f"{est.mean * f:.{digits}f}±{est.half_width * f:.{digits}f}"
    return f"{est.mean * f:.{digits if ci else 0}f}"


_COLUMNS = (("way", 12), ("n", 4), ("decode tok/s", 14), ("TTFT s", 14), ("e2e s", 14), ("total tok/s", 14))


def header(scale: float, max_tokens: int = DEFAULT_MAX_TOKENS) -> str:
    """What the table holds, and its column titles (at most WIDTH columns)."""
    lines = []
    if scale != 1.0:
        lines.append(f"emulators at --time-scale {scale}: tok/s and seconds are rescaled to profile time")
    lines.append(
        f"answers of {max_tokens} tokens; per way: n measured requests, per-request decode tok/s, time to "
        "first token,"
    )
    lines.append("end-to-end time (mean±95% CI) and total tok/s of all its requests")
    lines.append(f"{'conc':>4}  " + "".join(f"{t:<{w}}" if t == "way" else f"{t:>{w}}" for t, w in _COLUMNS))
    return "\n".join(lines)


def specroute_verdict(row: Row) -> str:
    """specroute against 2x baseline on end-to-end time, as `specroute compare` judges it."""
    base, other = (row.summaries.get(w) for w in ("2x baseline", "specroute"))
    if base is None or other is None:
        return "-"
    return verdict(E2E.get(base), E2E.get(other), E2E.higher_is_better)


def _rel(base: Any, other: Any) -> str:
    if base is None or other is None or base.mean == 0:
        return "?"
    return f"{(other.mean - base.mean) / base.mean * 100:+.1f}%"


def _n(s: LevelSummary | None, attr: str) -> int:
    est = getattr(s, attr, None) if s is not None else None
    return est.n if est is not None else 0


def verdict_line(row: Row) -> str:
    """specroute vs 2x baseline on e2e, with the requests behind the verdict."""
    base, pair = row.summaries.get("2x baseline"), row.summaries.get("specroute")
    if base is None or pair is None:
        return "specroute vs 2x baseline: -"
    return (
        f"specroute vs 2x baseline, end-to-end: {specroute_verdict(row)} "
        f"({_rel(base.e2e_s, pair.e2e_s)}; n={_n(pair, 'e2e_s')} and {_n(base, 'e2e_s')})"
    )


def why_line(row: Row, max_tokens: int, scale: float = 1.0) -> str:
    """Why specroute sent the share it did to EAGLE-3: the EAGLE-3 server against the plain one
    at this concurrency (both alone), on end-to-end time and what makes it up."""
    total = sum(row.chosen.values())
    share = f"chose eagle {100 * row.chosen.get('eagle', 0) / total:.0f}%" if total else "chose eagle -"
    plain, eagle = row.summaries.get("baseline"), row.summaries.get("eagle")
    if plain is None or eagle is None or plain.e2e_s is None or eagle.e2e_s is None:
        return share
    e2e = verdict(plain.e2e_s, eagle.e2e_s, False)
    n = f"n={_n(eagle, 'e2e_s')} and {_n(plain, 'e2e_s')}"
    decode = _rel(plain.decode_tok_s, eagle.decode_tok_s)
    ttft = "?"
    if plain.ttft_s is not None and eagle.ttft_s is not None:
        ttft = f"{(eagle.ttft_s.mean - plain.ttft_s.mean) / scale * 1000:+.0f} ms"
    said = {
        "faster": "answers sooner than",
        "slower": "answers later than",
        "not distinguishable": "is not distinguishable from",
    }[e2e]
    out = (
        f"{share}: at {row.concurrency} in flight the EAGLE-3 server alone {said} the plain one "
        f"(e2e {_rel(plain.e2e_s, eagle.e2e_s)}, {n}): decode {decode}, TTFT {ttft}"
    )
    decode_verdict = verdict(plain.decode_tok_s, eagle.decode_tok_s, True)
    eagle_decodes_faster = decode_verdict == "faster"
    if plain.ttft_s is not None and eagle.ttft_s is not None and eagle.ttft_s.mean > 5 * plain.ttft_s.mean:
        cap = f" (it runs at most {row.eagle_cap} at once)" if row.eagle_cap else ""
        out += f"; its requests wait in its queue{cap}"
    if e2e != "faster" and eagle_decodes_faster:
        out += f"; TTFT decides on {max_tokens}-token answers, not decode"
    elif e2e != "faster" and decode_verdict == "slower":
        out += "; its per-request decode is slower at this batch size"
    elif e2e != "faster" and decode_verdict == "not distinguishable":
        out += "; its per-request decode is no faster at this batch size"
    return out


def _wrap(text: str, indent: int = 6) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=" " * indent, subsequent_indent=" " * (indent + 2))


def format_row(row: Row, scale: float, max_tokens: int = DEFAULT_MAX_TOKENS) -> str:
    """One level: a line per way, then the verdict and why eagle was (not) chosen."""
    lines = []
    for i, way in enumerate(WAYS):
        s = row.summaries.get(way)
        cells = [
            way,
            str(s.ok if s is not None else 0),
            _fmt_est(s, "decode_tok_s", scale, True),
            _fmt_est(s, "ttft_s", scale, True, 3),
            _fmt_est(s, "e2e_s", scale, True, 3 if (s and s.e2e_s and s.e2e_s.mean / scale < 10) else 2),
            _fmt_est(s, "total_tok_s", scale, False),
        ]
        conc = f"{row.concurrency:>4}" if i == 0 else " " * 4
        body = "".join(
            f"{c:<{w}}" if t == "way" else f"{c:>{w}}" for c, (t, w) in zip(cells, _COLUMNS, strict=True)
        )
        lines.append(f"{conc}  {body}".rstrip())
    lines += _wrap("verdict: " + verdict_line(row))
    lines += _wrap("why: " + why_line(row, max_tokens, scale))
    return "\n".join(lines)


README_SECTION = '"When specroute helps" (docs/when-specroute-helps.md)'


def eagle_lead(profile: Profile) -> float | None:
    """How much faster the profile's EAGLE-3 mode decodes a lone stream than its plain mode."""
    try:
        plain, eagle = (profile.mode(m).points[0] for m in POOLS)
    except (KeyError, IndexError, ProfileError):
        return None
    return eagle.decode_tok_s / plain.decode_tok_s - 1.0


def summary_sentence(rows: Sequence[Row], lead: float | None = None) -> str:
    """What the comparison shows (specroute against 2x baseline, level by level) and where a
    pair would win, pointing to docs/when-specroute-helps.md; `lead`: `eagle_lead` of the profile."""
    counts: dict[str, list[int]] = {"faster": [], "not distinguishable": [], "slower": []}
    for r in rows:
        v = specroute_verdict(r)
        if v in counts:
            counts[v].append(r.concurrency)

    def at(v: str) -> str:
        levels = counts[v]
        return f"{len(levels)}" + (f" ({', '.join(map(str, levels))})" if levels else "")

    profile_lead = ""
    if lead is not None:
        profile_lead = f" (this profile's EAGLE-3 decodes a lone stream {lead:+.1%} faster)"
    return (
        "This compares specroute (one plain and one EAGLE-3 server) with 2x baseline (two plain servers, "
        f"the same hardware) on end-to-end time: specroute is faster at {at('faster')} of {len(rows)} "
        f"concurrency levels, not distinguishable at {at('not distinguishable')}, slower at {at('slower')}. "
        "A pair wins where EAGLE-3 is much faster than plain for a few requests at a time and the plain "
        f"server's throughput is needed under load{profile_lead}. {README_SECTION} shows where a pair "
        "pays and how to check your own servers with `specroute plan`."
    )


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


PANELS = (
    ("decode_tok_s", "per-request decode tok/s"),
    ("ttft_s", "TTFT s"),
    ("e2e_s", "end-to-end s"),
    ("total_tok_s", "total tok/s"),
)
"""The table's columns, a panel each, in its order."""


def plot_figure(rows: list[Row], scale: float, title: str) -> Any:
    """The figure: the table's columns (decode, TTFT, e2e, total tok/s) of every way, a point per
    table row, with 95% intervals; in profile time as the table."""
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(11, 7.6))
    axes = list(grid.flat)
    xs = [r.concurrency for r in rows]
    for ax, (attr, label) in zip(axes, PANELS, strict=True):
        f = scale if attr.endswith("tok_s") else 1.0 / scale
        for way in WAYS:
            ys, errs = [], []
            for r in rows:
                est = getattr(r.summaries.get(way), attr, None)
                ys.append(est.mean * f if est is not None else float("nan"))
                half = est.half_width if est is not None else None
                errs.append(half * f if half is not None else 0.0)
            style = "--" if way == "2x baseline" else "-"
            ax.errorbar(xs, ys, yerr=errs, marker="o", linestyle=style, capsize=3, label=way)
        ax.set_xscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label + " (95% CI)")
        ax.set_title(label, fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
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
    print()
    for line in textwrap.wrap(summary_sentence(rows, eagle_lead(resolve_profile(args.profile))), WIDTH):
        print(line)
    print(f"done in {took:.0f} s; n = measured requests per way and level; ± is a 95% t-interval;")
    print("verdicts as `specroute compare` judges them: not distinguishable when the intervals overlap;")
    print("chose eagle: specroute's share of requests sent to the EAGLE-3 server")
    if not args.no_plot and rows:
        title = plot_title(args)
        try:
            print(write_plot(rows, args.time_scale, Path(args.plot), title))
        except OSError as e:
            print(f"specroute demo: error: cannot write the plot to {args.plot}: {e}", file=sys.stderr)
            return 1
    return 0
