"""SGLang interop for `specroute bench`: reading `/server_info`, and turning the result lines of
`python -m sglang.benchmark.serving --output-file FILE` into profile points.

The keys read were checked against SGLang's source (python/sglang/benchmark/serving.py,
`benchmark()`'s `result` dict): `max_concurrency` (None when the run used a request rate
without a concurrency cap), `completed`, `mean_ttft_ms`, `mean_tpot_ms` (mean over requests
of (latency - ttft) / (output_len - 1)), `median_itl_ms` (per streamed chunk), `accept_length`
(from `/server_info` `internal_states[0].avg_spec_accept_length`, None without speculation)
and `server_info` (the whole `/server_info` answer, with `max_running_requests`).

Per line: concurrency = max_concurrency; decode tok/s = 1000 / mean_tpot_ms, or when that
is missing 1000 / median_itl_ms x accept_length (one chunk carries about accept_length
tokens under speculation); ttft_s = mean_ttft_ms / 1000; samples = completed. Several lines
at the same concurrency are combined, weighted by `completed`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from controller.proxy.engines import server_info_cap
from policies.base import Pool
from policies.jsonl import read_jsonl
from policies.profile import Profile, parse_profile


class SglangImportError(ValueError):
    """An SGLang result file that yields no profile; the message names the file and line."""


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def parse_server_info(info: Any) -> dict[str, Any]:
    """Fields of an SGLang `/server_info` answer that matter for speed; None when absent."""
    out: dict[str, Any] = {
        "avg_spec_accept_length": None,
        "max_running_requests": None,
        "speculative_algorithm": None,
        "speculative_num_steps": None,
    }
    if not isinstance(info, dict):
        return out
    decode = info.get("decode")
    if isinstance(decode, list) and decode and isinstance(decode[0], dict):
        info = decode[0]  # disaggregated prefill/decode: the decode server sets the speed
    states = info.get("internal_states")
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    accept = _num(state.get("avg_spec_accept_length"))
    out["avg_spec_accept_length"] = accept if accept and accept > 0 else None
    out["max_running_requests"] = server_info_cap(info)
    algo = info.get("speculative_algorithm")
    out["speculative_algorithm"] = algo if isinstance(algo, str) else None
    steps = info.get("speculative_num_steps")
    if algo and isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
        out["speculative_num_steps"] = steps
    return out


def _point(line: dict[str, Any], where: str, warnings: list[str]) -> dict[str, Any] | None:
    conc = line.get("max_concurrency")
    if not isinstance(conc, int) or isinstance(conc, bool) or conc < 1:
        warnings.append(f"{where}: no max_concurrency (a request-rate run?): skipped")
        return None
    tpot = _num(line.get("mean_tpot_ms"))
    itl = _num(line.get("median_itl_ms"))
    accept = _num(line.get("accept_length"))
    if tpot and tpot > 0:
        decode = 1000.0 / tpot
    elif itl and itl > 0:
        decode = 1000.0 / itl * (accept if accept and accept > 0 else 1.0)
    else:
        warnings.append(f"{where}: neither mean_tpot_ms nor median_itl_ms: skipped")
        return None
    ttft = _num(line.get("mean_ttft_ms"))
    if ttft is None:
        warnings.append(f"{where}: no mean_ttft_ms: TTFT recorded as 0")
    completed = line.get("completed")
    samples = completed if isinstance(completed, int) and completed > 0 else 1
    return {
        "concurrency": conc,
        "decode_tok_s": decode,
        "ttft_s": max(ttft or 0.0, 0.0) / 1000.0,
        "samples": samples,
    }


SGLANG_SPECULATIVE_MAX_RUNNING = 48
"""SGLang's cap on running requests for a speculative server started without --max-running-requests."""


def import_sglang(
    path: str | Path, mode: Pool, name: str | None = None
) -> tuple[Profile, list[str], list[str]]:
    """A one-mode profile from SGLang benchmark result lines, warnings about skipped lines, and
    what was assumed for what the lines do not say."""
    p = Path(path)
    warnings: list[str] = []
    points: dict[int, list[dict[str, Any]]] = {}
    accepts: list[float] = []
    caps: list[int] = []
    for where, line in read_jsonl(p, error=SglangImportError):
        if not isinstance(line, dict):
            raise SglangImportError(f"{where}: expected a JSON object (one benchmark result per line)")
        pt = _point(line, where, warnings)
        if pt is None:
            continue
        points.setdefault(pt["concurrency"], []).append(pt)
        info = parse_server_info(line.get("server_info"))
        if info["max_running_requests"] is not None:
            caps.append(info["max_running_requests"])
        accept = _num(line.get("accept_length")) or info["avg_spec_accept_length"]
        if accept and accept > 0:
            accepts.append(accept)
    if not points:
        raise SglangImportError(
            f"{p}: no usable benchmark result lines ({'; '.join(warnings) or 'empty file'})"
        )
    merged = []
    for conc in sorted(points):
        group = points[conc]
        w = sum(g["samples"] for g in group)
        merged.append(
            {
                "concurrency": conc,
                "decode_tok_s": round(sum(g["decode_tok_s"] * g["samples"] for g in group) / w, 4),
                "ttft_s": round(sum(g["ttft_s"] * g["samples"] for g in group) / w, 5),
                "samples": w,
            }
        )
    mode_data: dict[str, Any] = {"points": merged}
    assumed: list[str] = []
    if caps:
        mode_data["max_running_requests"] = max(caps)
        assumed.append(f"max_running_requests {max(caps)}, from the results' server_info")
    elif mode == "eagle":
        mode_data["max_running_requests"] = SGLANG_SPECULATIVE_MAX_RUNNING
        assumed.append(
            f"max_running_requests {SGLANG_SPECULATIVE_MAX_RUNNING}: the results carry no server_info, "
            "and SGLang caps a speculative server at 48 running requests unless --max-running-requests "
            "says otherwise; if yours does, set max_running_requests in the written profile"
        )
    else:
        assumed.append(
            "no max_running_requests: the results carry no server_info, so the profile sets none and "
            "the simulator and cost_model model no server queue; set it in the written profile "
            "(SGLang's /server_info has it)"
        )
    if mode == "eagle" and accepts:
        mode_data["accept_length"] = round(sum(accepts) / len(accepts), 4)
    data = {
        "format": "specroute.profile/v1",
        "name": name or f"{p.stem} ({mode})",
        "source": f"imported from SGLang benchmark results {p.name} (python -m sglang.benchmark.serving)",
        "modes": {mode: mode_data},
    }
    assumed.append(
        "per max_concurrency: decode tok/s = 1000 / mean_tpot_ms (else 1000 / median_itl_ms x "
        "accept_length), TTFT = mean_ttft_ms; lines of one concurrency averaged, weighted by completed"
    )
    return parse_profile(data, str(p)), warnings, assumed
