"""Content-aware routing, live: the real proxy (cost_model, content-aware) in front of an emulated
plain and an emulated EAGLE-3 server whose acceptance follows content rules (`--accept-rules`:
code 1.4x the profile's accept length, poems 0.6x), driven through the OpenAI client (4 at a
time, alternating code and poem prompts, 200-token streamed answers). After `--warmup` requests,
the median of |true factor / predicted factor - 1| over the rest, with `spec_details` on (the
accept length is reported per request) and off (timing only).

The emulated EAGLE server runs the kimi profile's eagle mode twice as fast, so that eagle pays
for both kinds at low load and both keep being observed; the proxy is given the emulators'
speeds in wall time (the profile divided by `--time-scale`). Timing only, the model learns the
EAGLE server's speed against the profile, which includes whatever the emulator's speed differs
from its profile by (an emulator with a small time scale runs slower than its profile): that part
cannot be told from acceptance without the per-request report.

    python benchmarks/content_routing_live.py                     # both signals, time scale 0.2
    python benchmarks/content_routing_live.py --time-scale 0.05 --signals timing
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai
from aiohttp import web
from prometheus_client import CollectorRegistry

from controller.proxy.app import create_app
from controller.proxy.config import Settings
from controller.proxy.core import policy_context
from controller.proxy.ticket import RequestRecord
from policies.features import extract_features
from policies.profile import Profile, resolve_profile
from policies.registry import default_registry
from simulator.emulator.accept_rules import parse_accept_rules
from simulator.emulator.app import EmulatorConfig, run_emulator

RULES = [{"match": r"\bdef \w+\(", "factor": 1.4}, {"match": "(?i)poem", "factor": 0.6}]
CODE = (
    "Complete the following Python function.\n\ndef {name}(values):\n    '''Return the {what} of values.'''\n"
)
PROSE = "Write a short {what} poem about {name}, with a twist at the end."
WORDS = ["rivers", "trains", "owls", "winter", "markets", "lanterns", "glaciers", "bridges", "tides", "kites"]


def profiles(scale: float, folder: Path) -> tuple[Profile, Path]:
    """(the emulators' profile, the proxy's profile file: the same speeds in wall time)."""
    doc = resolve_profile("kimi-k25-int4-8gpu").model_dump(mode="json", exclude_none=True)
    for point in doc["modes"]["eagle"]["points"]:
        point["decode_tok_s"] *= 2
    wall: dict[str, Any] = json.loads(json.dumps(doc))
    for mode in wall["modes"].values():
        for point in mode["points"]:
            point["decode_tok_s"] /= scale
            point["ttft_s"] = point.get("ttft_s", 0.0) * scale
        if "prefill_tok_s" in mode:
            mode["prefill_tok_s"] /= scale
    path = folder / "wall.json"
    path.write_text(json.dumps(wall))
    return Profile.model_validate(doc), path


async def run(spec_details: bool, scale: float, requests: int, warmup: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        emulated, wall = profiles(scale, Path(tmp))
        rules = parse_accept_rules(RULES)
        base_cfg = EmulatorConfig(mode="baseline", profile=emulated, time_scale=scale)
        eagle_cfg = EmulatorConfig(mode="eagle", profile=emulated, time_scale=scale, accept_rules=rules)
        async with run_emulator(base_cfg) as base, run_emulator(eagle_cfg) as eagle:
            settings = Settings.model_validate(
                {"baseline": [base.url], "eagle": [eagle.url], "policy": "cost_model", "profile": str(wall),
                 "spec_details": spec_details, "health_check_interval_s": 60}
            )  # fmt: skip
            ctx = policy_context(settings)
            registry = default_registry(entry_points=False)
            policy = registry.create(settings.policy, settings.policy_params, ctx)
            records: list[RequestRecord] = []
            app = create_app(
                settings, policy, registry=registry, metrics_registry=CollectorRegistry(), context=ctx,
                observers=[records.append],
            )  # fmt: skip
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
            client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
            rng = random.Random(0)

            async def one(i: int) -> None:
                name, what = rng.choice(WORDS), rng.choice(("sum", "mean", "quiet", "bright"))
                text = (
                    CODE.format(name=f"{name}_{i}", what=what)
                    if i % 2
                    else PROSE.format(name=name, what=what)
                )
                stream = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": text}], max_tokens=200, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                )  # fmt: skip
                async for _ in stream:
                    pass

            for start in range(0, requests, 4):
                await asyncio.gather(*(one(i) for i in range(start, min(start + 4, requests))))
            await client.close()
            await runner.cleanup()
    code = extract_features({"messages": [{"role": "user", "content": CODE}]}, "chat").family
    errors, by_kind = [], {"code": [], "poem": []}  # type: ignore[var-annotated]
    for r in records[warmup:]:
        assert r.request.features is not None and r.decision.accept_factor is not None
        kind = "code" if r.request.features.family == code else "poem"
        truth = 1.4 if kind == "code" else 0.6
        errors.append(abs(truth / r.decision.accept_factor - 1))
        by_kind[kind].append(r.decision.accept_factor)
    return {
        "n": len(errors),
        "median_error": statistics.median(errors),
        "code": statistics.median(by_kind["code"]),
        "poem": statistics.median(by_kind["poem"]),
        "eagle_share": sum(r.decision.pool == "eagle" for r in records) / len(records),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--time-scale", type=float, default=0.2, help="Emulators' wall seconds per profile second."
    )
    p.add_argument("--requests", type=int, default=700)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--signals", nargs="+", choices=("spec", "timing"), default=["spec", "timing"])
    args = p.parse_args()
    print(f"{args.requests} requests, error over those after {args.warmup}; time scale {args.time_scale:g}")
    for signal in args.signals:
        t0 = time.perf_counter()
        r = asyncio.run(run(signal == "spec", args.time_scale, args.requests, args.warmup))
        label = "spec_details" if signal == "spec" else "timing only"
        print(
            f"{label:<13} median |true/predicted - 1| {r['median_error']:.3f} (n={r['n']}); predicted code "
            f"{r['code']:.3f} (true 1.4), poem {r['poem']:.3f} (true 0.6); eagle share "
            f"{r['eagle_share']:.0%}; {time.perf_counter() - t0:.0f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
