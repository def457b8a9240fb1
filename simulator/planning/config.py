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
plain server's cap, since it stops speculating under load. vLLM has no in-engine adaptive
speculation: its adaptive line is a speculative server, with a note.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence

import yaml

from policies.profile import Profile, ProfileError
from simulator.engine.runner import SINGLE_POOL_POLICY
from simulator.planning.plan import Deployment, PlanResult, deployment_label

DEFAULT_PORT = 30000
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


def vllm_launch_line(kind: str, profile: Profile, model_path: str, draft_model_path: str) -> list[str]:
    """vLLM's command for one server of `kind`, as shell words."""
    words = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
    words += ["--host", "0.0.0.0", "--port", str(DEFAULT_PORT)]
    cap = _cap(profile, "baseline" if kind != "eagle" else "eagle")
    if cap is not None:
        words += ["--max-num-seqs", str(cap)]
    if kind != "baseline":
        config = {"method": "eagle3", "model": draft_model_path, "num_speculative_tokens": 3}
        words += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    return words


def launch_line(kind: str, profile: Profile, model_path: str, draft_model_path: str) -> list[str]:
    """The command for one server of `kind` on the profile's engine, as shell words."""
    if profile_engine(profile) == "vllm":
        return vllm_launch_line(kind, profile, model_path, draft_model_path)
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
    words += [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        draft_model_path,
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
    ]
    cap = _cap(profile, "baseline" if kind == "adaptive" else "eagle")
    if cap is not None:
        words += ["--max-running-requests", str(cap)]
    if kind == "adaptive":
        words.append("--speculative-adaptive")
    return words


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
    for kind, n in dep:
        lines.append(f"# {_KIND_TITLE[kind]} server ({n}x):")
        lines += _wrap(launch_line(kind, profile, model_path, draft_model_path))
    if engine == "vllm" and any(kind == "adaptive" for kind, _ in dep):
        lines.append("# (vLLM has no in-engine adaptive speculation: the plan simulated SGLang's.)")
    elif any(kind == "adaptive" for kind, _ in dep):
        lines.append(
            "# (--speculative-adaptive needs --speculative-eagle-topk 1; SGLang picks the draft depth"
        )
        lines.append("#  by batch size. Adaptive servers are listed in the eagle pool: they speculate.)")
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
