"""The request bodies SGLang's serving benchmark sends, and a reader of its `/generate` stream.

Shapes from `sglang/benchmark/serving.py` of sglang 0.5.23 (`async_request_sglang_generate`,
`async_request_openai_completions`, `async_request_openai_chat_completions`) with the
benchmark's default arguments (--temperature 0.0, --top-p 1.0, ignore_eos on, streaming on,
--logprob-start-len -1, no LoRA). Written out as data here, not imported: the benchmark is not
a dependency. `read_generate_stream` follows the benchmark's reading of a native stream:
`text` is cumulative, the token count comes from `meta_info.completion_tokens`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp


def generate_body(prompt: str | list[int], output_len: int, *, stream: bool = True) -> dict[str, Any]:
    """`--backend sglang` (the default): POST /generate."""
    return {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": stream,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }


def completions_body(model: str, prompt: str, output_len: int) -> dict[str, Any]:
    """`--backend sglang-oai`: POST /v1/completions (no stream_options: the benchmark counts
    the text it gets)."""
    return {
        "model": model,
        "prompt": prompt,
        "best_of": 1,
        "max_tokens": output_len,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def chat_body(model: str, prompt: str, output_len: int) -> dict[str, Any]:
    """`--backend sglang-oai-chat`: POST /v1/chat/completions."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_completion_tokens": output_len,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }


@dataclass
class GenerateStream:
    status: int
    headers: dict[str, str]
    events: list[Any] = field(default_factory=list)
    """Decoded `data:` payloads; `[DONE]` kept as the string."""
    text: str = ""
    output_len: int = 0
    chunks_with_text: int = 0

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def last(self) -> dict[str, Any]:
        """The last output before [DONE]."""
        out = [e for e in self.events if isinstance(e, dict)]
        assert out, self.events
        return out[-1]


async def read_generate_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> GenerateStream:
    """POST a streamed /generate and read it line by line as SGLang's benchmark does."""
    async with session.post(url, json=body, headers=headers) as r:
        got = GenerateStream(r.status, dict(r.headers))
        if r.status != 200:
            got.events.append(await r.json(content_type=None))
            return got
        async for raw in r.content:
            line = raw.strip()
            if not line:
                continue
            payload = line.removeprefix(b"data: ")
            if payload == b"[DONE]":
                got.events.append("[DONE]")
                continue
            data = json.loads(payload)
            got.events.append(data)
            if data.get("text"):
                got.text = data["text"]
                got.output_len = data["meta_info"]["completion_tokens"]
                got.chunks_with_text += 1
    return got
