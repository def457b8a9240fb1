"""CLI wiring for `specroute bench`, `specroute compare` and `specroute profile merge`."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller.bench.categories import by_category, category_factors, describe
from controller.bench.compare import (
    MIN_REQUESTS,
    QUEUED_NOTE,
    compare_table,
    describe_runs,
    queued_levels,
    setting_warnings,
)
from controller.bench.prefill import DEFAULT_PREFILL_LENGTHS, DEFAULT_PREFILL_REPEATS
from controller.bench.progress import fmt_duration
from controller.bench.prompts import PromptError, PromptSet, load_prompts
from controller.bench.result import BenchResult, LevelResult, ResultFileError
from controller.bench.runner import DEFAULT_LEVELS, BenchConfig, BenchError, BenchRunner
from controller.bench.sglang_import import SglangImportError, import_sglang
from controller.cli.args import (
    CommandError,
    check_writable,
    non_negative_float,
    non_negative_int,
    number,
    positive_int,
    run_async,
)
from policies.profile import Profile, ProfileError, parse_profile, resolve_profile
from policies.stats import Estimate
from policies.together import describe as describe_together


def _header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition(":") if ":" in text else text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE or NAME=VALUE, got {text!r}")
    return key.strip(), value.strip()


FULL: dict[str, Any] = {
    "concurrency": list(DEFAULT_LEVELS),
    "requests_per_level": 30,
    "warmup_requests": 5,
    "max_tokens": 200,
}
QUICK: dict[str, Any] = {
    "concurrency": [1, 4, 16],
    "requests_per_level": 10,
    "warmup_requests": 1,
    "max_tokens": 64,
}
"""`--quick`: a short sweep (about half a minute per server at Kimi-like speeds)."""


def configure_bench(b: argparse.ArgumentParser) -> None:
    b.description = (
        "Closed-loop concurrency sweep against an OpenAI-compatible server "
        "(SGLang, the emulator, or specroute). Or, with --import-sglang, turn SGLang's "
        "benchmark results into a profile."
    )
    b.add_argument("url", nargs="?", metavar="URL", help="server base URL, e.g. http://127.0.0.1:30000")
    b.add_argument(
        "--concurrency",
        type=positive_int,
        nargs="+",
        default=None,
        metavar="N",
        help=f"concurrency levels (default: {' '.join(map(str, FULL['concurrency']))}; --quick: "
        f"{' '.join(map(str, QUICK['concurrency']))})",
    )
    b.add_argument(
        "--requests-per-level",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"measured requests per level (default: {FULL['requests_per_level']}; --quick: "
        f"{QUICK['requests_per_level']})",
    )
    b.add_argument(
        "--warmup-requests",
        type=non_negative_int,
        default=None,
        metavar="N",
        help=f"warm-up requests per level, not counted (default: {FULL['warmup_requests']}; --quick: "
        f"{QUICK['warmup_requests']})",
    )
    b.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"output tokens per request (default: {FULL['max_tokens']}; --quick: {QUICK['max_tokens']})",
    )
    b.add_argument(
        "--quick",
        action="store_true",
        help="a short sweep to see a server's shape in about half a minute: levels "
        f"{' '.join(map(str, QUICK['concurrency']))}, {QUICK['requests_per_level']} requests per level "
        f"after {QUICK['warmup_requests']} warm-up, max_tokens {QUICK['max_tokens']} (flags given "
        "explicitly win); too few requests for a profile you rely on",
    )
    b.add_argument(
        "--prompts",
        default="coding",
        metavar="SET|FILE",
        help="built-in set 'coding' (default) or 'general', or a JSONL file with "
        '{"messages": [...]} or {"prompt": "..."} per line; lines with a "category" get accept length '
        "and decode speed per category (95%% CIs), written as priors into the eagle profile",
    )
    b.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/v1/chat/completions (default) or /v1/completions",
    )
    b.add_argument("--model", default=None, help="model name to send (default: first of /v1/models)")
    b.add_argument("--label", default=None, help="name of this run in results and comparisons")
    b.add_argument(
        "--temperature", type=non_negative_float, default=0.0, help="sampling temperature sent (default: 0.0)"
    )
    b.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (SGLang extension)")
    b.add_argument("--timeout", type=number, default=600.0, metavar="S", help="per-request timeout")
    b.add_argument(
        "--header",
        type=_header,
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="extra request header, e.g. x-specroute-mode:eagle (repeatable; specroute honours "
        "that one only with allow_client_override on)",
    )
    b.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    b.add_argument("--out", metavar="FILE", help="write raw results and summaries (JSON)")
    b.add_argument("--profile-out", metavar="FILE", help="write a specroute.profile/v1 for --mode")
    b.add_argument("--mode", choices=("baseline", "eagle"), help="mode of the written profile")
    b.add_argument(
        "--together",
        metavar="URL2",
        help="measure URL2 at the same time, level by level (servers sharing cores slow each other): "
        "URL2 gets the other --mode, --out's result for it goes beside --out (NAME.together.json), "
        "and --profile-out gets both modes as measured together (`profile merge --together` makes "
        "them the together points of a profile measured alone)",
    )
    b.add_argument(
        "--rounds",
        type=int,
        default=None,
        metavar="N",
        help="with --together: each level measured alone and together in turn, N together runs "
        "between N+1 alone runs of each server (each run --requests-per-level requests), so the "
        "machine's drift falls on both alike; prints each server's slowdown per level with its "
        "rounds' range, --profile-out gets each mode's alone points with its together points (no "
        "`profile merge --together` needed), --out's alone results go beside it (NAME.alone.json, "
        "NAME.together.alone.json)",
    )
    b.add_argument("--profile-name", default=None, help="name field of the written profile")
    b.add_argument(
        "--import-sglang",
        metavar="FILE.jsonl",
        help="instead of measuring: profile points from `python -m sglang.benchmark.serving` results",
    )
    b.add_argument(
        "--prefill",
        action="store_true",
        help="before the sweep, measure the prefill rate (TTFT against prompt length, fresh prompts, "
        "concurrency 1) and the prefix cache (the same long prompt twice); the profile gets "
        "prefill_tok_s and cache_tokens",
    )
    b.add_argument(
        "--prefill-lengths",
        type=positive_int,
        nargs="+",
        default=list(DEFAULT_PREFILL_LENGTHS),
        metavar="TOKENS",
        help="prompt lengths of --prefill (default: %(default)s)",
    )
    b.add_argument(
        "--prefill-repeats",
        type=positive_int,
        default=DEFAULT_PREFILL_REPEATS,
        metavar="N",
        help="fresh prompts per length, and cold/warm pairs, of --prefill (default: %(default)s)",
    )
    b.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (a bar on a terminal; elsewhere, e.g. a log, a line every few seconds)",
    )
    b.set_defaults(func=run_bench)


def configure_compare(c: argparse.ArgumentParser) -> None:
    c.add_argument("results", nargs="+", metavar="RESULT", help="files written by `specroute bench --out`")
    c.set_defaults(func=run_compare)


def configure_profile(p: argparse.ArgumentParser) -> None:
    psub = p.add_subparsers(dest="profile_command", metavar="SUBCOMMAND")
    m = psub.add_parser("merge", help="merge one-mode profiles (baseline + eagle) into one")
    m.add_argument("inputs", nargs="+", metavar="PROFILE", help="profile files (or built-in names)")
    m.add_argument("-o", "--out", required=True, metavar="FILE")
    m.add_argument("--name", default=None)
    m.add_argument(
        "--together",
        metavar="PROFILE",
        help="a profile of the same servers measured together (`specroute bench URL --together URL2`): "
        "its points become each mode's together points, the speed while the other server is busy "
        "(co-located servers; the simulator then slows a server while its partner runs); with it one "
        "input is enough",
    )
    m.set_defaults(func=run_profile_merge)

    def usage(args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=usage)


def _fmt(e: Estimate | None, digits: int) -> str:
    if e is None:
        return "-"
    ci = "?" if e.half_width is None else f"{e.half_width:.{digits}f}"
    return f"{e.mean:.{digits}f} ± {ci}"


def level_line(lv: LevelResult, queued: str | None = None) -> str:
    """One level of the bench table; `queued`: the evidence that its requests queued."""
    s = lv.summary
    d = s.decode_tok_s
    pct = "" if d is None else f" (p50 {d.p50:.1f} p90 {d.p90:.1f} p99 {d.p99:.1f})"
    other = f" (+{s.other_errors} warm-up/filler)" if s.other_errors else ""
    line = (
        f"concurrency {s.concurrency:>4}: n={s.n} errors={s.errors}{other}  "
        f"decode {_fmt(d, 2)} tok/s{pct}  TTFT {_fmt(s.ttft_s, 4)} s  "
        f"e2e {_fmt(s.e2e_s, 3)} s  total {_fmt(s.total_tok_s, 1)} tok/s  wall {s.wall_s:.1f} s"
    )
    if queued:
        line += f"\n    {QUEUED_NOTE} ({queued})"
    kinds = Counter((r.error or "")[:100] for r in lv.requests if not r.ok)
    for message, count in kinds.most_common(3):
        line += f"\n    {count} x {message}"
    return line


def _write_profile(profile: Profile, path: str) -> None:
    Path(path).write_text(profile.to_json(), encoding="utf-8")


def run_bench(args: argparse.Namespace) -> int:
    if args.profile_out and not args.mode:
        raise CommandError("--profile-out needs --mode baseline|eagle")
    if args.import_sglang:
        if args.url:
            raise CommandError("give either a URL to measure or --import-sglang FILE, not both")
        if not args.mode:
            raise CommandError("--import-sglang needs --mode baseline|eagle")
        try:
            profile, warnings, assumptions = import_sglang(args.import_sglang, args.mode, args.profile_name)
        except (SglangImportError, ProfileError) as e:
            raise CommandError(str(e)) from None
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        for note in assumptions:
            print(f"assumed: {note}", file=sys.stderr)
        if args.profile_out:
            try:
                _write_profile(profile, args.profile_out)
            except OSError as e:
                raise CommandError(f"cannot write {args.profile_out}: {e.strerror or e}") from None
            print(f"wrote {args.profile_out}: {len(profile.mode(args.mode).points)} points ({args.mode})")
        else:
            sys.stdout.write(profile.to_json())
        return 0
    if not args.url:
        raise CommandError("a server URL is required (or --import-sglang FILE)")
    for key, full in FULL.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else full)
    check_writable(args.out, args.profile_out)
    headers = dict(args.header)
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    try:
        prompts = load_prompts(args.prompts)
        config = BenchConfig(
            url=args.url,
            levels=tuple(args.concurrency),
            requests_per_level=args.requests_per_level,
            warmup=args.warmup_requests,
            max_tokens=args.max_tokens,
            prompts=prompts,
            endpoint=args.endpoint,
            label=args.label,
            model=args.model,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            timeout_s=args.timeout,
            headers=headers,
            prefill_lengths=tuple(args.prefill_lengths) if args.prefill else (),
            prefill_repeats=args.prefill_repeats,
        )
    except (PromptError, ValueError) as e:
        raise CommandError(str(e)) from None
    if len(prompts) < max(config.levels):
        print(
            f"warning: prompt set {prompts.name} has {len(prompts)} prompts, fewer than the "
            f"largest concurrency {max(config.levels)}: concurrent requests will share prompts",
            file=sys.stderr,
        )

    if config.requests_per_level < MIN_REQUESTS:
        print(
            f"warning: {config.requests_per_level} requests per level (< {MIN_REQUESTS}) are too few "
            "to distinguish differences of a few percent",
            file=sys.stderr,
        )

    def on_level(lv: LevelResult) -> None:
        print(level_line(lv, queued_levels(runner.result).get(lv.concurrency)), flush=True)
        eta = runner.sweep.sweep_eta_s()
        if eta is not None and lv.concurrency != config.levels[-1]:
            print(f"    sweep: {fmt_duration(eta)} to go (estimate)", flush=True)

    if args.rounds is not None and not args.together:
        raise CommandError("--rounds needs --together URL2 (it interleaves alone and together runs)")
    if args.rounds is not None and args.rounds < 1:
        raise CommandError(f"--rounds must be at least 1, got {args.rounds}")
    if args.together and args.rounds is not None:
        return _run_rounds(args, config)
    if args.together:
        return _run_together(args, config)
    runner = BenchRunner(config, on_level=on_level, progress=not args.no_progress)
    print(
        f"bench {args.url}: levels {' '.join(map(str, config.levels))}, {config.requests_per_level} "
        f"requests per level after {config.warmup} warm-up, max_tokens {config.max_tokens}, "
        f"prompts {prompts.name} ({len(prompts)})",
        flush=True,
    )
    interrupted = False
    try:
        run_async(runner.run())
    except KeyboardInterrupt:
        interrupted = True
    except BenchError as e:
        raise CommandError(str(e)) from None
    result = runner.result
    if runner.prefill is not None:
        print(runner.prefill.describe())
    if interrupted:
        result.metadata["interrupted"] = True
        print(f"interrupted: keeping {len(result.levels)} finished level(s)", file=sys.stderr)
    info = result.metadata.get("server_info") or {}
    if info.get("endpoint"):
        print(
            f"server info: speculative_algorithm={info.get('speculative_algorithm')} "
            f"avg_spec_accept_length={info.get('avg_spec_accept_length')} "
            f"max_running_requests={info.get('max_running_requests')}"
        )
        spec = info.get("speculative_algorithm") not in (None, "", "NONE")
        if args.mode == "eagle" and not spec:
            print("warning: --mode eagle, but the server reports no speculative algorithm", file=sys.stderr)
        if args.mode == "baseline" and spec:
            print(
                f"warning: --mode baseline, but the server runs {info.get('speculative_algorithm')}",
                file=sys.stderr,
            )
    if prompts.categorized:
        report_categories(result)
    return _write_outputs(args, result, interrupted)


def _second_server(args: argparse.Namespace, config: BenchConfig) -> BenchConfig:
    """`--together URL2`'s config: URL's with URL2 (which gets the other `--mode`)."""
    from dataclasses import replace

    if not args.mode:
        raise CommandError("--together needs --mode (of URL; URL2 gets the other one)")
    try:
        return replace(config, url=args.together, label=None)
    except ValueError as e:
        raise CommandError(f"--together: {e}") from None


def _run_together(args: argparse.Namespace, config: BenchConfig) -> int:
    """`--together URL2` (controller.bench.together): both sweeps at once, one two-mode profile."""
    from controller.bench.together import other, run_together, together_profile, with_suffix

    second = _second_server(args, config)
    print(f"bench {args.url} ({args.mode}) together with {args.together} ({other(args.mode)})", flush=True)
    try:
        first_result, second_result = run_async(
            run_together(config, second, on_level=lambda lv: print(level_line(lv), flush=True))
        )
    except BenchError as e:
        raise CommandError(str(e)) from None
    code = 0
    for path, result in (
        (args.out, first_result),
        (args.out and with_suffix(args.out, "together"), second_result),
    ):
        if path:
            result.write(path)
            print(f"wrote {path}")
    if isinstance(config.prompts, PromptSet) and config.prompts.categorized:
        report_categories(eagle_of((first_result, second_result), args.mode))
    if args.profile_out:
        try:
            profile = together_profile(first_result, second_result, args.mode, args.profile_name)
            _write_profile(profile, args.profile_out)
        except (ResultFileError, ProfileError, OSError) as e:
            print(f"specroute bench: no profile written: {e}", file=sys.stderr)
            return 1
        print(f"wrote {args.profile_out}: modes {', '.join(profile.modes)}")
    return code


def _run_rounds(args: argparse.Namespace, config: BenchConfig) -> int:
    """`--together URL2 --rounds N` (controller.bench.together.run_rounds): alone and together in
    turn, one profile with each mode's alone points and together points."""
    from controller.bench.together import describe_factors, other, run_rounds, together_profile, with_suffix

    second = _second_server(args, config)
    modes = (args.mode, other(args.mode))
    print(
        f"bench {args.url} ({modes[0]}) and {args.together} ({modes[1]}), alone and together in turn: "
        f"{args.rounds} together runs between {args.rounds + 1} alone runs of each, per level",
        flush=True,
    )

    def on_run(kind: str, k: int, i: int, lv: LevelResult) -> None:
        print(f"  round {k} {kind:8s} {modes[i]:8s} {level_line(lv)}", flush=True)

    try:
        rounds = run_async(run_rounds(config, second, args.rounds, on_run=on_run))
    except BenchError as e:
        raise CommandError(str(e)) from None
    for line in describe_factors(rounds, modes):
        print(line)
    if isinstance(config.prompts, PromptSet) and config.prompts.categorized:
        for kind, results in (("alone", rounds.alone), ("together", rounds.together)):
            print(f"eagle, {kind}:")
            report_categories(eagle_of(results, args.mode))
    if args.out:
        together_path = with_suffix(args.out, "together")
        for path, result in (
            (args.out, rounds.together[0]),
            (together_path, rounds.together[1]),
            (with_suffix(args.out, "alone"), rounds.alone[0]),
            (with_suffix(together_path, "alone"), rounds.alone[1]),
        ):
            try:
                result.write(path)
            except OSError as e:
                print(f"specroute bench: cannot write {path}: {e.strerror or e}", file=sys.stderr)
                return 1
            print(f"wrote {path}")
    if args.profile_out:
        try:
            alone = [
                (args.url, rounds.alone[0].to_profile(modes[0])),
                (args.together, rounds.alone[1].to_profile(modes[1])),
            ]
            together = together_profile(*rounds.together, args.mode)
            profile = merge_profiles(
                alone, args.profile_name or f"{args.url} + {args.together}, alone and together",
                together=("measured together in the same rounds", together),
            )  # fmt: skip
            _write_profile(profile, args.profile_out)
        except (ResultFileError, ProfileError, OSError) as e:
            print(f"specroute bench: no profile written: {e}", file=sys.stderr)
            return 1
        print(f"wrote {args.profile_out}: modes {', '.join(profile.modes)}, each with together points")
    return 0


def eagle_of(results: Sequence[BenchResult], mode: str) -> BenchResult:
    """The eagle server's result of a pair measured as (URL with `mode`, URL2 with the other)."""
    return results[0] if mode == "eagle" else results[1]


def report_categories(result: BenchResult) -> None:
    """Per-category acceptance and speed (`controller.bench.categories`): printed, and kept in the
    result's metadata (the profile's eagle mode gets the speed factors as `categories`)."""
    summaries = by_category(result.levels, result.metadata.get("category_probe"))
    accept = (result.metadata.get("server_info") or {}).get("avg_spec_accept_length")
    factors = category_factors(summaries, accept if isinstance(accept, int | float) else None)
    result.metadata["categories"] = [s.to_json() for s in summaries]
    result.metadata["category_factors"] = factors
    print(describe(summaries, factors, probed=bool(result.metadata.get("category_probe"))))


def _write_outputs(args: argparse.Namespace, result: BenchResult, interrupted: bool) -> int:
    code = 130 if interrupted else 0
    if args.out:
        try:
            result.write(args.out)
        except OSError as e:
            print(f"specroute bench: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
            code = code or 1
        else:
            print(f"wrote {args.out}")
    if args.profile_out:
        try:
            profile = result.to_profile(args.mode, args.profile_name)
        except (ResultFileError, ProfileError) as e:
            print(f"specroute bench: no profile written: {e}", file=sys.stderr)
            return code or 1
        try:
            _write_profile(profile, args.profile_out)
        except OSError as e:
            print(f"specroute bench: cannot write {args.profile_out}: {e.strerror or e}", file=sys.stderr)
            return code or 1
        print(f"wrote {args.profile_out}: {len(profile.mode(args.mode).points)} points ({args.mode})")
    return code


def _names(runs: Sequence[BenchResult], paths: Sequence[str]) -> list[str]:
    labels = [r.label for r in runs]
    if len(set(labels)) == len(labels):
        return labels
    return [f"{lab} ({Path(p).name})" for lab, p in zip(labels, paths, strict=True)]


def run_compare(args: argparse.Namespace) -> int:
    try:
        runs = [BenchResult.read(p) for p in args.results]
    except ResultFileError as e:
        raise CommandError(str(e)) from None
    names = _names(runs, args.results)
    table, warnings = compare_table(runs, names)
    print("\n".join(describe_runs(runs, names)))
    for w in setting_warnings(runs, names):  # before the table: every verdict below depends on it
        print(f"warning: {w}")
    print(
        "cells: mean ± 95% CI half-width (n); vs [1]: relative difference and verdict "
        "(intervals overlap = not distinguishable; TTFT: lower is faster)"
    )
    print()
    print(table)
    for w in warnings:
        print(f"warning: {w}")
    return 0


def merge_profiles(
    profiles: Sequence[tuple[str, Profile]],
    name: str | None = None,
    together: tuple[str, Profile] | None = None,
) -> Profile:
    """One profile with the modes of all inputs; a mode present twice is an error. `together`'s
    modes (a profile measured with both servers busy) become the modes' together points."""
    modes: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for path, prof in profiles:
        for mode, mode_profile in prof.modes.items():
            if mode in modes:
                raise ProfileError(
                    f"both {origin[mode]} and {path} have a {mode!r} mode: merge needs profiles "
                    "with different modes (one baseline, one eagle)"
                )
            modes[mode] = mode_profile.model_dump(mode="json", exclude_none=True)
            origin[mode] = path
    sources = [f"{path}: {p.source}" for path, p in profiles]
    if together is not None:
        path, prof = together
        for mode, measured in prof.modes.items():
            if mode not in modes:
                raise ProfileError(
                    f"{path} has a {mode!r} mode but the profiles merged have none (they have: "
                    f"{', '.join(modes)}): --together needs a profile of the same servers"
                )
            if "together" in modes[mode]:
                raise ProfileError(f"both {origin[mode]} and {path} give together points for {mode!r}")
            points = [p.model_dump(mode="json", exclude_none=True) for p in measured.points]
            spec: dict[str, Any] = {"points": points}
            if measured.prefill_tok_s is not None:
                spec["prefill_tok_s"] = measured.prefill_tok_s
            modes[mode]["together"] = spec
        sources.append(f"together points from {path}: {prof.source}")
    data: dict[str, Any] = {
        "format": "specroute.profile/v1",
        "name": name or " + ".join(p.name for _, p in profiles),
        "source": "merged: " + " | ".join(sources),
        "modes": modes,
    }
    engines = {(p.model_extra or {}).get("engine") for _, p in profiles}
    if len(engines) == 1 and (engine := engines.pop()) is not None:
        data["engine"] = engine  # measured on one engine: `plan` writes its launch lines
    return parse_profile(data, "<merged profile>")


def run_profile_merge(args: argparse.Namespace) -> int:
    if len(args.inputs) < 2 and not args.together:
        raise CommandError("give at least two profiles to merge (or one and --together PROFILE)")
    try:
        together_with = None if args.together is None else (args.together, resolve_profile(args.together))
        merged = merge_profiles([(p, resolve_profile(p)) for p in args.inputs], args.name, together_with)
    except ProfileError as e:
        raise CommandError(str(e)) from None
    if together_with is not None and not (together_with[1].model_extra or {}).get("measured_together"):
        print(
            f"warning: {args.together} does not say it was measured together (bench --together writes "
            "measured_together: true): its points are taken as the speeds with both servers busy",
            file=sys.stderr,
        )
    try:
        _write_profile(merged, args.out)
    except OSError as e:
        raise CommandError(f"cannot write {args.out}: {e.strerror or e}") from None
    print(f"wrote {args.out}: modes {', '.join(merged.modes)}")
    note = describe_together(merged)
    if note is not None:
        print(note)
    return 0
