"""The `specroute serve` config `specroute plan` writes for its winner, with launch lines.

The YAML body holds `baseline` and `eagle` URL lists sized as planned (placeholder hosts under
the reserved `.invalid` domain, to be replaced), `policy`, `policy_params` and `profile`. A
single-pool deployment gets the `fixed` policy on its pool, which routes least-loaded within
the pool (what the plan simulated). Adaptive servers speculate, so they form the `eagle` pool.

The comments carry one launch line per server kind, for the engine the profile was measured on
(its `engine` field, written by `specroute bench`; SGLang when it has none): SGLang's
`python -m sglang.launch_server`, or vLLM's `python -m vllm.entrypoints.openai.api_server` (and
then `engine: vllm` in the config). Servers get their running-request cap from the profile
because that cap is what the plan simulated (`--max-running-requests`; SGLang otherwise caps a
speculative server at 48; vLLM's `--max-num-seqs`); an adaptive server is simulated with the
plain server's cap, since it stops speculating under load. An adaptive server follows the plan's
ladder: SGLang's `--speculative-adaptive` (with `--speculative-adaptive-config FILE`, its JSON
written in the comments, unless the ladder is SGLang's default), or vLLM's
`num_speculative_tokens_per_batch_size` in `--speculative-config`: the depths the ladder settles
at for the profile's acceptance (`policies.ladder.Ladder.vllm_schedule`), which is what the plan
simulated.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence

import yaml

from policies.adaptive import DepthModel
from policies.ladder import SGLANG_DEFAULT, Ladder
from policies.profile import Profile, ProfileError
from simulator.engine.deployment import DEFAULT_LADDER
from simulator.engine.runner import SINGLE_POOL_POLICY
from simulator.planning.plan import Deployment, PlanResult, deployment_label

DEFAULT_PORT = 30000
ADAPTIVE_CONFIG_FILE = "adaptive.json"
"""Where the SGLang launch line expects a non-default ladder's `--speculative-adaptive-config`."""
_KIND_TITLE = {"baseline": "plain", "eagle": "EAGLE-3", "adaptive": "adaptive EAGLE-3"}


def placeholder_urls(dep: Deployment) -> dict[str, list[str]]:
    """`baseline`/`eagle` URL lists, one placeholder per planned server."""
    urls: dict[str, list[str]] = {"baseline": [], "eagle": []}
    for kind, n in dep:
        pool = "baseline" if kind == "baseline" else "eagle"
        urls[pool] += [f"http://{kind}-{i}.invalid:{DEFAULT_PORT}" for i in range(1, n + 1)]
    return urls


def _cap(profile: Profile, mode: str) -> int | None:
    try:
        return profile.speed("baseline" if mode == "baseline" else "eagle").max_running_requests
    except ProfileError:
        return None


def profile_engine(profile: Profile) -> str:
    """The engine a profile was measured on: its `engine` field (`specroute bench` writes it),
    else "sglang"."""
    engine = (profile.model_extra or {}).get("engine")
    return engine if engine in ("sglang", "vllm") else "sglang"


VLLM_DEFAULT_MAX_NUM_SEQS = 256
"""vLLM's own default `--max-num-seqs` (GPU), the last batch a schedule covers without a cap."""


def vllm_schedule(profile: Profile, ladder: Ladder, max_batch: int | None) -> list[list[int]]:
    """The vLLM schedule of `ladder` at the profile's acceptance, up to `max_batch`."""
    alpha = DepthModel.of(profile.mode("eagle")).alpha
    return ladder.vllm_schedule(alpha, max_batch or VLLM_DEFAULT_MAX_NUM_SEQS)


def vllm_launch_line(
    kind: str, profile: Profile, model_path: str, draft_model_path: str, ladder: Ladder = DEFAULT_LADDER
) -> list[str]:
    """vLLM's command for one server of `kind`, as shell words."""
    words = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
    words += ["--host", "0.0.0.0", "--port", str(DEFAULT_PORT)]
    cap = _cap(profile, "baseline" if kind != "eagle" else "eagle")
    if cap is not None:
        words += ["--max-num-seqs", str(cap)]
    if kind != "baseline":
        config: dict[str, object] = {"method": "eagle3", "model": draft_model_path}
        config["num_speculative_tokens"] = 3
        if kind == "adaptive":
            schedule = vllm_schedule(profile, ladder, cap)
            config["num_speculative_tokens"] = max(1, max(k for _, _, k in schedule))
            config["num_speculative_tokens_per_batch_size"] = schedule
        words += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    return words


def sglang_adaptive_config(ladder: Ladder) -> dict[str, object] | None:
    """The `--speculative-adaptive-config` object of `ladder`; None for SGLang's default ladder
    (no file needed)."""
    if ladder.same_depths(SGLANG_DEFAULT):
        return None
    return {
        str(b.min_batch): {
            "candidate_steps": list(b.steps),
            "up_hysteresis": b.up_hysteresis,
            "down_hysteresis": b.down_hysteresis,
        }
        for b in ladder.buckets
    }


def launch_line(
    kind: str, profile: Profile, model_path: str, draft_model_path: str, ladder: Ladder = DEFAULT_LADDER
) -> list[str]:
    """The command for one server of `kind` on the profile's engine, as shell words."""
    if profile_engine(profile) == "vllm":
        return vllm_launch_line(kind, profile, model_path, draft_model_path, ladder)
    words = [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        "0.0.0.0",
        "--port",
        str(DEFAULT_PORT),
        "--enable-metrics",
    ]
    if kind == "baseline":
        return words
    # an adaptive server starts its buckets at --speculative-num-steps, which must be a candidate
    steps = ladder.initial if kind == "adaptive" else 3
    words += [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        draft_model_path,
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(steps + 1),
    ]
    cap = _cap(profile, "baseline" if kind == "adaptive" else "eagle")
    if cap is not None:
        words += ["--max-running-requests", str(cap)]
    if kind == "adaptive":
        words.append("--speculative-adaptive")
        if sglang_adaptive_config(ladder) is not None:
            words += ["--speculative-adaptive-config", ADAPTIVE_CONFIG_FILE]
    return words


def _adaptive_notes(engine: str, ladder: Ladder) -> list[str]:
    """What the comments say under an adaptive server's launch line."""
    if engine == "vllm":
        return [
            "# (num_speculative_tokens_per_batch_size: the draft depth per batch-size range, as the plan",
            f"#  simulated it for the ladder {ladder.describe()}. Adaptive servers are in the eagle pool.)",
        ]
    lines = []
    config = sglang_adaptive_config(ladder)
    if config is not None:
        lines.append(f"# {ADAPTIVE_CONFIG_FILE} (the plan's ladder):")
        lines.append("#   " + json.dumps(config, separators=(",", ":")))
    lines += [
        "# (--speculative-adaptive needs --speculative-eagle-topk 1; SGLang picks the draft depth by",
        "#  batch size. Adaptive servers are listed in the eagle pool: they speculate.)",
    ]
    return lines


def _wrap(words: Sequence[str], indent: str = "#   ") -> list[str]:
    """Shell words as commented lines of at most ~100 characters, continued with backslashes.

    A flag and its value stay on one line.
    """
    groups: list[str] = []
    for w in map(shlex.quote, words):
        if groups and not w.startswith("--") and groups[-1].startswith("--") and " " not in groups[-1]:
            groups[-1] += " " + w
        else:
            groups.append(w)
    lines: list[str] = []
    current = ""
    for g in groups:
        if current and len(indent) + len(current) + 1 + len(g) > 98:
            lines.append(indent + current + " \\")
            current = "    " + g
        else:
            current = f"{current} {g}" if current else g
    lines.append(indent + current)
    return lines


def _fmt(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.4g}"


def config_text(
    result: PlanResult,
    profile: Profile,
    profile_ref: str,
    *,
    command: str,
    model_path: str = "MODEL_PATH",
    draft_model_path: str = "EAGLE3_DRAFT_MODEL_PATH",
) -> str:
    """The config for the winner at load factor 1."""
    ref = result.reference
    best = ref.best
    dep = best.deployment
    urls = placeholder_urls(dep)
    if best.choice.name == SINGLE_POOL_POLICY:
        policy, params = "fixed", {"pool": "baseline" if urls["baseline"] else "eagle"}
    else:
        policy, params = best.choice.name, dict(best.choice.params)
    spec = result.spec
    score = best.score
    lines = [
        "# specroute config written by `specroute plan`.",
        f"# command: {command}",
        f"# winner at the given load: {deployment_label(dep)} with {policy} {json.dumps(params)}",
        f"# objective {spec.objective} = {_fmt(score.mean)} (95% CI {_fmt(score.low)}..{_fmt(score.high)}, "
        f"{score.n} seeds: {', '.join(map(str, spec.seeds))})",
    ]
    if ref.tied_with_best:
        lines.append(f"# within the noise of: {', '.join(ref.tied_with_best)} (a tie, not a win)")
    for lr in result.loads:
        if lr.factor != 1.0:
            tie = f" (tied with {', '.join(lr.tied_with_best)})" if lr.tied_with_best else ""
            lines.append(f"# at {lr.factor:g}x the load the best is {lr.best.label}{tie}")
    engine = profile_engine(profile)
    label = "vLLM" if engine == "vllm" else "SGLang"
    lines += [
        "#",
        "# Replace the placeholder URLs (hosts under .invalid: `specroute serve` refuses them) with",
        f"# your servers' URLs: one {label} server per host, one model.",
        f"# {label} launch lines (replace MODEL_PATH / EAGLE3_DRAFT_MODEL_PATH):",
    ]
    ladder = spec.ladder
    for kind, n in dep:
        lines.append(f"# {_KIND_TITLE[kind]} server ({n}x):")
        lines += _wrap(launch_line(kind, profile, model_path, draft_model_path, ladder))
    if any(kind == "adaptive" for kind, _ in dep):
        lines += _adaptive_notes(engine, ladder)
    settings: dict[str, object] = {
        "baseline": urls["baseline"],
        "eagle": urls["eagle"],
        "policy": policy,
        "policy_params": params,
        "profile": profile_ref,
    }
    if engine == "vllm":
        settings["engine"] = "vllm"
    body = yaml.safe_dump(settings, sort_keys=False, default_flow_style=False)
    return "\n".join(lines) + "\n" + body
