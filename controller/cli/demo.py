"""`specroute demo`: where a pair of servers pays and where it does not, on one machine, no
GPU and no arguments needed.

How it works: for each act (by default three: Llama-3.1-8B, whose EAGLE-3 is 2.4x faster than
plain for a lone stream; Kimi-K2.5, whose EAGLE-3 is 3.7% faster alone and half as fast under
load; and "content", the real engine's profile, whose EAGLE-3 is faster on code and slower on
prose) it starts emulated SGLang servers (`specroute emulate`) and three routers on the same
hardware, two servers each, as child processes: specroute (`specroute serve`, `cost_model`) over
one plain and one EAGLE-3 server, and a least-loaded router over two plain servers ("2x
baseline") and over two EAGLE-3 servers ("2x EAGLE-3") -- the alternatives an operator faces.
Each way has servers of its own, so no way's traffic or caches touch another's. It drives a
closed-loop concurrency sweep through the three, one after the other, and prints a table per
profile: per level and way the measured requests, per-request decode tok/s, TTFT, end-to-end
time (each with its 95% interval) and total tok/s; under each level specroute against both
alternatives on end-to-end time, and why specroute sent the share it did to EAGLE-3 (2x EAGLE-3
against 2x baseline at that load); `controller.cli.demo_report` words and judges them. A summary
under the tables says, from the same judgements, where the pair paid.

The content act: the EAGLE-3 emulators accept by prompt (`--accept-rules`, code and prose at the
profile's per-domain factors), specroute learns from each answer's accept length
(`--spec-details true`) and reads the profile in the emulators' wall time, the traffic is half
code and half prose (`controller.bench.domain_prompts`, generated, never seen), and every way
answers the same never-seen warm-up prompts before the sweep; its figures are stratified by
domain (`demo_report.stratified_summary`), and its why line gives EAGLE-3 against plain per
domain and specroute's EAGLE-3 share per domain.

While a level runs, a progress line on stderr (a terminal). It writes the same figures as a PNG
when matplotlib is installed. Children are stopped after each act, on exit, on error and on
Ctrl-C (and die with the demo on Linux even if it is killed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import signal
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from controller.bench.domain_prompts import mixed
from controller.bench.prompts import Prompt, PromptSet
from controller.bench.result import LevelResult
from controller.bench.runner import run_sweep
from controller.cli import spawn
from controller.cli.args import CommandError, bounded, positive_float, positive_int, run_async
from controller.cli.demo_report import (
    PAIR,
    TWO_EAGLE,
    TWO_PLAIN,
    WAYS,
    WIDTH,
    ActResult,
    Row,
    closing,
    column_titles,
    domain_estimates,
    format_row,
    header,
    plot_figure,
    stratified_summary,
    wrap_paragraphs,
)
from policies.base import POOLS, Pool
from policies.profile import Profile, ProfileError, resolve_profile
from policies.registry import default_registry
from policies.spec import PolicyError


@dataclass(frozen=True)
class Act:
    """One profile of the demo and the concurrency levels it is swept at."""

    name: str
    """What `--act` calls it."""
    profile: str
    levels: tuple[int, ...]
    quick_levels: tuple[int, ...]
    content: bool = False
    """EAGLE-3's acceptance depends on the prompt: 50/50 code and prose traffic, acceptance rules
    for the EAGLE-3 emulators, `spec_details` for specroute, and a warm-up before the sweep."""


CONTENT_PROFILE = "tiny-vllm-cpu-code-eagle3"
ACTS = (
    Act("llama", "llama31-8b-h100-eagle3", (1, 4, 16), (1, 16)),
    Act("kimi", "kimi-k25-int4-8gpu", (1, 10, 30), (1, 10)),
    Act("content", CONTENT_PROFILE, (1, 2, 4), (1, 2), content=True),
)
"""The default: a profile where the pair beats two plain servers, one where it does not, and one
where EAGLE-3 helps code and hurts prose, so routing by content beats both alternatives."""
ACT_NAMES = tuple(a.name for a in ACTS)
PROFILE_LEVELS, PROFILE_QUICK_LEVELS = (1, 2, 5, 10, 30, 70), (1, 10)
"""--profile: one profile, swept at these levels (--quick: those)."""
REQUESTS, QUICK_REQUESTS = 12, 6
"""Measured requests per way and level (at least one per client): enough to resolve the
differences the default profiles show (at least 5% on end-to-end time) on a busy machine."""
DEFAULT_MAX_TOKENS, QUICK_MAX_TOKENS = 128, 64
"""Answers long enough that decode speed, not only TTFT, shapes the end-to-end time."""
CONTENT_REQUESTS, CONTENT_QUICK_REQUESTS = 16, 8
"""The content act's measured requests per way and level, half code, half prose. Its figures are
stratified (`demo_report.stratified_summary`): each domain's spread, not the gap between code and
prose, sets their intervals, so these resolve differences of a few percent."""
CONTENT_MAX_TOKENS = 64
"""The content act's answers: the real engine's profile was measured with 64-token answers."""
CONTENT_WARMUP = 48
"""Never-seen prompts (half code, half prose, 2 in flight) every way of the content act answers
before its sweep: what specroute's content model learns from. Measured over 96: the share of
prose it sent to EAGLE-3 fell from 8/8 in the first 16 prompts to 2/8 in the third 16 and stayed
near it (the rest: exploration, and prose sent to an idle EAGLE-3 server while the plain one is
busy)."""
CONTENT_WARMUP_CONCURRENCY = 2
CODE_PATTERN = "Complete the following Python function"
PROSE_PATTERN = "Write a short story about|Describe the "
"""How the EAGLE-3 emulators tell the generated prompts' domains apart (`emulate --accept-rules`)."""
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


def _requests_for(c: int, quick: bool, content: bool = False) -> int:
    if content:
        return max(CONTENT_QUICK_REQUESTS if quick else CONTENT_REQUESTS, c)
    return max(QUICK_REQUESTS if quick else REQUESTS, c)


def acts_for(args: argparse.Namespace) -> list[Act]:
    """The acts to run (--profile: that profile alone; --act: those) with their levels (--levels:
    for each)."""
    if args.profile is not None:
        acts = [Act("profile", args.profile, PROFILE_LEVELS, PROFILE_QUICK_LEVELS)]
    else:
        chosen = getattr(args, "act", None)
        acts = [a for a in ACTS if not chosen or a.name in chosen]
    if args.levels:
        return [replace(a, levels=tuple(args.levels), quick_levels=tuple(args.levels)) for a in acts]
    return acts


def max_tokens_for(act: Act, args: argparse.Namespace) -> int:
    if args.max_tokens:
        return int(args.max_tokens)
    if act.content:
        return CONTENT_MAX_TOKENS
    return QUICK_MAX_TOKENS if args.quick else DEFAULT_MAX_TOKENS


def accept_rules(profile: Profile) -> list[dict[str, Any]]:
    """The EAGLE-3 emulators' `--accept-rules` for the content act: code and prose prompts at
    the profile's measured factor of each (its eagle `categories`)."""
    factors = profile.mode("eagle").categories or {}
    missing = [d for d in ("code", "prose") if d not in factors]
    if missing:
        raise ProfileError(f"profile {profile.name!r} has no eagle categories {', '.join(missing)}")
    return [
        {"match": CODE_PATTERN, "factor": factors["code"]},
        {"match": PROSE_PATTERN, "factor": factors["prose"]},
    ]


def wall_time_profile(profile: Profile, scale: float) -> dict[str, Any]:
    """`profile` in the wall time of emulators at `--time-scale scale`: rates divided by it,
    seconds multiplied. specroute times what it learns from by the wall clock, so with the
    profile's own figures it would take emulators at 0.5 for servers twice as fast as the profile
    says, and a pool it has not tried yet for twice as slow as the one it has."""
    data: dict[str, Any] = profile.model_dump(mode="json", exclude_none=True)
    data["name"] = f"{profile.name}, in wall time at --time-scale {scale:g}"
    for mode in data["modes"].values():
        if "prefill_tok_s" in mode:
            mode["prefill_tok_s"] /= scale
        for points in (mode["points"], mode.get("together", {}).get("points", [])):
            for point in points:
                point["decode_tok_s"] /= scale
                point["ttft_s"] *= scale
    return data


def write_content_files(folder: Path, profile: Profile, scale: float) -> tuple[Path, Path]:
    """The content act's files: the EAGLE-3 emulators' acceptance rules and the profile
    specroute reads (`wall_time_profile`)."""
    rules, wall = folder / "accept-rules.json", folder / "profile-wall-time.json"
    rules.write_text(json.dumps(accept_rules(profile), indent=2) + "\n", encoding="utf-8")
    wall.write_text(json.dumps(wall_time_profile(profile, scale), indent=2) + "\n", encoding="utf-8")
    return rules, wall


def domain_prompts(stream: str, n: int) -> PromptSet:
    """`n` generated chat prompts of `stream`, alternating code and prose, each with its domain as
    its category (so `run_sweep` asks for and records each request's accept length)."""
    return PromptSet(
        f"generated {stream}",
        tuple(
            Prompt(messages=({"role": "user", "content": text},), category=d) for d, text in mixed(stream, n)
        ),
    )


def eagle_by_domain(level: LevelResult, phase: str = "measured") -> dict[str, tuple[int, int]]:
    """Per domain, (requests EAGLE-3 answered, requests) among the answered `phase` requests: an
    EAGLE-3 server reports the request's accept length, a plain one does not."""
    out: dict[str, tuple[int, int]] = {}
    for r in level.requests:
        if r.phase == phase and r.ok and r.category is not None:
            eagle, total = out.get(r.category, (0, 0))
            out[r.category] = (eagle + (r.accept_length is not None), total + 1)
    return out


async def _start_servers(
    kids: Children, act: Act, args: argparse.Namespace, rules: Path | None, wall_profile: Path | None
) -> dict[str, str]:
    """Start one act's emulators and the three routers; the URL of each way. `wall_profile`: the
    profile specroute reads (default: the act's)."""
    profile = act.profile
    common = ["--profile", profile, "--port", "0", "--time-scale", str(args.time_scale)]
    modes = ("baseline", "eagle", "baseline", "baseline", "eagle", "eagle")
    by_content = ["--accept-rules", str(rules)] if rules is not None else []
    plain, eagle, plain2a, plain2b, eagle2a, eagle2b = await asyncio.gather(
        *(
            kids.start(
                f"{mode} emulator {i}",
                ["emulate", "--mode", mode, *common, *(by_content if mode == "eagle" else [])],
                "listening",
            )
            for i, mode in enumerate(modes)
        )
    )
    # Quick probes and scrapes; and no shutdown grace: no balancer polls the demo's /ready, so
    # the 5 s of `shutdown_grace_s` would only hold the demo's exit up.
    fast = ["--port", "0", "--health-check-interval-s", "0.5", "--scrape-interval-s", "0.5"]
    fast += ["--shutdown-grace-s", "0"]
    specroute = ["serve", "--baseline", plain, "--eagle", eagle, "--policy", args.policy]
    specroute += ["--profile", str(wall_profile or profile)]
    if act.content:  # learn each request's acceptance from what the EAGLE-3 server reports
        specroute += ["--spec-details", "true"]
    two_plain = ["serve", "--baseline", f"{plain2a},{plain2b}", "--policy", "fixed", "--policy-param"]
    two_eagle = ["serve", "--eagle", f"{eagle2a},{eagle2b}", "--policy", "fixed", "--policy-param"]
    proxy, pair, eagles = await asyncio.gather(
        kids.start("specroute", [*specroute, *fast], "listening"),
        kids.start("2x baseline router", [*two_plain, "pool=baseline", *fast], "listening"),
        kids.start("2x EAGLE-3 router", [*two_eagle, "pool=eagle", *fast], "listening"),
    )
    await asyncio.gather(_wait_ready(proxy), _wait_ready(pair), _wait_ready(eagles))
    print(f"specroute ({args.policy}): {proxy} over one plain and one EAGLE-3 server")
    if act.content:
        print("  spec_details on: specroute learns from each request's accept length")
    print(f"  servers: plain {plain}, EAGLE-3 {eagle}")
    print(f"2x baseline: {pair} over two plain servers, least loaded first")
    print(f"  servers: plain {plain2a} and {plain2b}")
    print(f"2x EAGLE-3: {eagles} over two EAGLE-3 servers, least loaded first")
    print(f"  servers: EAGLE-3 {eagle2a} and {eagle2b}")
    sys.stdout.flush()
    return {PAIR: proxy, TWO_PLAIN: pair, TWO_EAGLE: eagles}


def _say(text: str) -> None:
    """A paragraph of the content act's, wrapped as the tables are."""
    for line in textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False):
        print(line)
    sys.stdout.flush()


def _shares(counts: dict[str, tuple[int, int]]) -> str:
    """`code 16/16, prose 1/16`."""
    return ", ".join(f"{d} {e}/{n}" for d, (e, n) in sorted(counts.items())) or "no requests"


async def _warm_up(urls: dict[str, str], max_tokens: int) -> None:
    """Every way answers the same `CONTENT_WARMUP` never-seen prompts (the three at once: each has
    its own servers); say what specroute sent where while it learned."""
    prompts = domain_prompts("demo-warmup", CONTENT_WARMUP)
    _say(
        f"warm-up: each way first answers the same {CONTENT_WARMUP} never-seen prompts (half code, half "
        f"prose, {CONTENT_WARMUP_CONCURRENCY} in flight); specroute learns from their outcomes which "
        "prompts EAGLE-3 speeds up",
    )
    sweeps = await asyncio.gather(
        *(
            run_sweep(
                urls[way],
                levels=(CONTENT_WARMUP_CONCURRENCY,),
                requests_per_level=CONTENT_WARMUP,
                warmup=0,
                max_tokens=max_tokens,
                prompts=prompts,
                ignore_eos=True,
                label=f"{way} warm-up",
                timeout_s=300,
            )
            for way in WAYS
        )
    )
    pair = sweeps[WAYS.index(PAIR)].levels[0]
    half = sorted((r for r in pair.requests if r.phase == "measured"), key=lambda r: r.start_s)
    late = LevelResult(pair.concurrency, half[len(half) // 2 :], pair.summary)
    _say(
        f"  specroute sent to EAGLE-3 during the warm-up: {_shares(eagle_by_domain(pair))} "
        f"(its second half: {_shares(eagle_by_domain(late))})",
    )


async def run_act(act: Act, args: argparse.Namespace, log_dir: Path, progress: bool) -> ActResult:
    """Start one act's servers, (content act) warm every way up, sweep the three ways level by
    level (printing each level as it ends), and stop the servers."""
    profile = resolve_profile(act.profile)
    max_tokens = max_tokens_for(act, args)
    result = ActResult(act.profile, profile.name, content=act.content)
    print(f"\n== {act.profile}: {profile.name} ==", flush=True)
    levels = act.quick_levels if args.quick else act.levels
    eagle_cap = profile.mode("eagle").max_running_requests
    folder = Path(tempfile.mkdtemp(prefix="profile-", dir=log_dir))  # --profile may be a path
    rules = wall = None
    if act.content:
        rules, wall = write_content_files(folder, profile, args.time_scale)
        code, prose = json.loads(rules.read_text(encoding="utf-8"))
        _say(
            f"50/50 code and prose prompts, generated here, never seen before; answers of {max_tokens} "
            f"tokens; the EAGLE-3 servers accept as the measured drafter did: code x{code['factor']:.3f} "
            f"and prose x{prose['factor']:.3f} its mean accept length ({rules.name}); specroute reads "
            f"the profile in the emulators' wall time ({wall.name})",
        )
    kids = Children(folder)
    try:
        urls = await _start_servers(kids, act, args, rules, wall)
        if act.content:
            await _warm_up(urls, max_tokens)
        print(column_titles(), flush=True)
        for c in levels:
            row = Row(c, eagle_cap=eagle_cap)
            n = _requests_for(c, args.quick, act.content)
            prompts = domain_prompts(f"demo-level-{c}", n + 2 * c) if act.content else None
            for way in WAYS:
                before = await _decisions(urls[way]) if way == PAIR else None
                sweep = await run_sweep(
                    urls[way], levels=(c,), requests_per_level=n, warmup=0, max_tokens=max_tokens,
                    ignore_eos=True, label=way, timeout_s=300, progress=progress,
                    prompts=prompts if prompts is not None else "coding",
                )  # fmt: skip
                level = sweep.levels[0]
                row.summaries[way] = stratified_summary(level) if act.content else level.summary
                if act.content:
                    row.domain_e2e[way] = domain_estimates(level, "e2e_s")
                if before is not None:
                    after = await _decisions(urls[way])
                    row.chosen = {p: round(after[p] - before[p]) for p in POOLS}
                    if act.content:
                        row.eagle_by_domain = eagle_by_domain(sweep.levels[0])
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
            results.append(await run_act(act, args, Path(tmp), progress))
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
        help="a shorter sweep (two levels per act, fewer requests, 64-token answers)",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--act",
        nargs="+",
        choices=ACT_NAMES,
        help="run these acts only (default: all, "
        + "; ".join(f"{a.name}: {a.profile}" for a in ACTS)
        + "; content: EAGLE-3 helps code and hurts prose, 50/50 traffic)",
    )
    which.add_argument(
        "--profile",
        help="run one speed profile (a built-in name or a JSON file) instead of the acts, "
        f"at levels {' '.join(map(str, PROFILE_LEVELS))}",
    )
    p.add_argument("--policy", default="cost_model", help="specroute policy (default: cost_model)")
    p.add_argument(
        "--levels",
        type=positive_int,
        nargs="+",
        help="concurrency levels, for every act (default: "
        + "; ".join(f"{a.profile} {' '.join(map(str, a.levels))}" for a in ACTS)
        + ")",
    )
    p.add_argument(
        "--max-tokens",
        type=bounded(int, ge=2),
        help=f"output tokens per request (default: {DEFAULT_MAX_TOKENS}; --quick: {QUICK_MAX_TOKENS}; the "
        f"content act: {CONTENT_MAX_TOKENS})",
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
            if act.content:
                accept_rules(profile)
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
    if any(a.content for a in acts):
        print("the content act's decode, TTFT and e2e are stratified: the mean of the code and the prose")
        print("means, the intervals from the spread within each (the traffic is half of each by design)")
    if not args.no_plot and acts:
        try:
            print(write_plot(acts, args.time_scale, Path(args.plot), plot_title(args)))
        except OSError as e:
            print(f"specroute demo: error: cannot write the plot to {args.plot}: {e}", file=sys.stderr)
            return 1
    return 0
