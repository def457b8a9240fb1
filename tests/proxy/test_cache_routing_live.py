"""Cache-aware against cache-blind routing, live: `specroute serve` in front of emulators that
model SGLang's prefix cache, several multi-turn conversations replayed at once with the openai
client. What a user sees: with `cost_model` (prefix-aware by default) every later turn of a
conversation lands where its earlier turns are cached and reports `cached_tokens`; with
`prefix_aware=false` conversations are split across servers and pay their prefill again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
from helpers import Turn, block_text, cache_profile, replay_conversation

BLOCK_TOKENS = 512
CONVERSATIONS = 6
SYSTEM_BLOCKS = 8


async def _replay(emulator: Any, spawn_serve: Any, tmp_path: Path, *params: str) -> list[list[Turn]]:
    # 2,000 prompt tokens/s: a 4,096-token system prompt costs 2 s of prefill (0.2 s wall at
    # time scale 0.1), so where it is cached matters far more than a request or two of load
    profile = cache_profile(prefill_tok_s=2000, cache_tokens=200_000)
    path = tmp_path / "profile.json"
    path.write_text(profile.to_json())
    servers = [
        await emulator(profile=profile, time_scale=0.1, enable_cache_report=True),
        await emulator(profile=profile, time_scale=0.1, enable_cache_report=True),
        await emulator(mode="eagle", profile=profile, time_scale=0.1, enable_cache_report=True),
    ]
    policy_params = [a for p in params for a in ("--policy-param", p)]
    sp = await spawn_serve(
        "--baseline", f"b0={servers[0].url}", "--baseline", f"b1={servers[1].url}",
        "--eagle", f"e0={servers[2].url}", "--profile", str(path), "--policy", "cost_model",
        *policy_params,
    )  # fmt: skip
    client = openai.AsyncOpenAI(base_url=sp.url + "/v1", api_key="k", max_retries=0, timeout=60)
    try:
        return list(
            await asyncio.gather(
                *(
                    replay_conversation(
                        client,
                        block_text(SYSTEM_BLOCKS, f"conversation {c} system prompt"),
                        [f"question {k} of conversation {c}" for k in range(4)],
                    )
                    for c in range(CONVERSATIONS)
                )
            )
        )
    finally:
        await client.close()


def _later_cached(conversations: list[list[Turn]]) -> list[int]:
    return [t.cached_tokens for turns in conversations for t in turns[1:]]


async def test_cache_aware_routing_keeps_conversations_where_they_are_cached(
    emulator: Any, spawn_serve: Any, tmp_path: Path
) -> None:
    aware = await _replay(emulator, spawn_serve, tmp_path)
    system = SYSTEM_BLOCKS * BLOCK_TOKENS
    for turns in aware:
        assert turns[0].cached_tokens == 0, turns
        assert len({t.backend for t in turns}) == 1, turns  # one server per conversation
        for t in turns[1:]:
            assert t.cached_tokens >= system // 2, turns
    # different conversations share nothing, so they spread over the servers by load
    assert len({turns[0].backend for turns in aware}) >= 2, aware


async def test_cache_blind_routing_splits_conversations_and_loses_hits(
    emulator: Any, spawn_serve: Any, tmp_path: Path
) -> None:
    blind_dir, aware_dir = tmp_path / "blind", tmp_path / "aware"
    blind_dir.mkdir()
    aware_dir.mkdir()
    blind = await _replay(emulator, spawn_serve, blind_dir, "prefix_aware=false")
    aware = await _replay(emulator, spawn_serve, aware_dir)
    # the blind router moves some conversation to a server that has not seen it
    assert any(len({t.backend for t in turns}) > 1 for turns in blind), blind
    assert sum(_later_cached(blind)) < sum(_later_cached(aware)), (blind, aware)
    assert min(_later_cached(blind)) < SYSTEM_BLOCKS * BLOCK_TOKENS // 2 <= min(_later_cached(aware))
