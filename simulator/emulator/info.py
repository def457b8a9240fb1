"""The emulator's load and info answers: `/v1/loads` and `/server_info` (SGLang 0.5.23 shapes).

Deviation, on purpose: `/v1/loads` reports live running/waiting counts (SGLang's are at most a
few decode steps old).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from simulator.emulator.state import Emulator

SGLANG_VERSION = "0.5.23"


def _spec_section(e: Emulator) -> dict[str, float] | None:
    if e.config.mode != "eagle":
        return None
    st = e.engine.stats
    return {"accept_length": st.spec_accept_length, "accept_rate": st.spec_accept_rate}


def loads_body(e: Emulator) -> dict[str, Any]:
    engine = e.engine
    cap = engine.max_running_requests
    used = engine.used_tokens()
    load: dict[str, Any] = {
        "dp_rank": 0,
        "timestamp": time.time(),
        "num_running_reqs": engine.num_running,
        "num_waiting_reqs": engine.num_queued,
        "num_used_tokens": used,
        "num_total_tokens": used,
        "max_total_num_tokens": engine.max_total_num_tokens,
        "token_usage": used / engine.max_total_num_tokens,
        "gen_throughput": engine.stats.gen_throughput,
        "cache_hit_rate": engine.stats.cache_hit_rate,
        "utilization": engine.num_running / cap,
        "max_running_requests": cap,
        "queues": {"waiting": engine.num_queued, "grammar": 0, "paused": 0, "retracted": 0},
    }
    spec = _spec_section(e)
    if spec is not None:
        load["speculative"] = spec
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": SGLANG_VERSION,
        "accelerator": "specroute emulator",
        "num_accelerators": 0,
        "loads": [load],
    }


def server_info_body(e: Emulator, request: web.Request) -> dict[str, Any]:
    c = e.config
    engine = e.engine
    eagle = c.mode == "eagle"
    steps = c.speculative_num_steps if eagle else None
    state: dict[str, Any] = {
        "effective_max_running_requests_per_dp": engine.max_running_requests,
        "last_gen_throughput": engine.stats.gen_throughput,
        "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": engine.max_total_num_tokens},
        "cache_hit_rate": engine.stats.cache_hit_rate,
        "token_usage": engine.stats.token_usage,
    }
    avg = engine.avg_accept_length()
    if avg is not None:
        state["avg_spec_accept_length"] = avg
    host, _, port = (request.host or "").rpartition(":")
    return {
        "model_path": c.model,
        "tokenizer_path": c.model,
        "served_model_name": c.model,
        "host": host or None,
        "port": int(port) if port.isdigit() else None,
        "context_length": c.max_model_len,
        "max_running_requests": engine.max_running_requests,
        "max_queued_requests": e.faults.max_queued_requests,
        "speculative_algorithm": "EAGLE3" if eagle else None,
        "speculative_num_steps": steps,
        "speculative_eagle_topk": 1 if eagle else None,
        "speculative_num_draft_tokens": steps + 1 if steps is not None else None,
        "speculative_adaptive": c.speculative_adaptive,
        "speculative_adaptive_config": c.speculative_adaptive_config,
        "cuda_graph_bs": None,
        "disable_cuda_graph": True,
        "tp_size": 1,
        "dp_size": 1,
        "enable_metrics": True,
        "disable_radix_cache": c.disable_radix_cache,
        "enable_cache_report": c.enable_cache_report,
        "max_total_num_tokens": engine.max_total_num_tokens,
        "internal_states": [state],
        "version": SGLANG_VERSION,
        "specroute_emulator": {
            "mode": c.mode,
            "profile": c.profile.name,
            "time_scale": c.time_scale,
            "accept_length": c.effective_accept_length,
        },
    }
