"""`policies.features`: one extractor for the proxy and the simulator; compact, stable, bounded,
never the text, never a crash on odd bodies."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from controller.proxy.request import estimate_prompt_tokens
from policies.base import EndpointKind
from policies.features import (
    HEAD_CHARS,
    MAX_GRAMS,
    TAIL_CHARS,
    TRAIT_BITS,
    estimate_prompt_chars,
    extract_features,
    request_text,
    text_grams,
)

CODE = "Complete the following Python function.\n\ndef add(a: int, b: int) -> int:\n    return a + b\n"


def chat(*messages: tuple[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in messages], **extra}


def test_parameters_are_copied_and_text_becomes_hashed_grams() -> None:
    body = chat(
        ("system", "You are a careful coder."),
        ("user", CODE),
        model="kimi",
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        n=2,
        response_format={"type": "json_object"},
        tools=[{"type": "function", "function": {"name": "run", "description": "Run code"}}],
    )
    f = extract_features(body, "chat")
    assert (f.temperature, f.top_p, f.top_k, f.n, f.tools) == (0.7, 0.9, 40, 2, 1)
    assert f.response_format == "json_object"
    assert f.model != 0 and f.family != 0
    assert f.grams == tuple(sorted(set(f.grams))) and 0 < len(f.grams) <= MAX_GRAMS
    assert all(isinstance(g, int) and g >= 0 for g in f.grams)
    # the same system prompt names the same family whatever the question; another one another family
    other = extract_features(chat(("system", "You are a careful coder."), ("user", "hello")), "chat")
    assert other.family == f.family
    assert extract_features(chat(("system", "You write poems."), ("user", CODE)), "chat").family != f.family
    # without a system prompt: the first line of the first user message
    a = extract_features(chat(("user", CODE)), "chat")
    b = extract_features(chat(("user", "Complete the following Python function.\n\ndef x(): pass")), "chat")
    assert a.family == b.family != 0


def test_only_the_last_user_message_and_system_prompt_count() -> None:
    early = chat(("user", "tell me a story about dragons"), ("assistant", "Once upon"), ("user", CODE))
    late = chat(("user", CODE))
    assert extract_features(early, "chat").grams == extract_features(late, "chat").grams


def test_hashes_are_stable_across_processes() -> None:
    """blake2b and CRC-32, never Python's salted hash: another interpreter gets the same ids."""
    code = (
        "from policies.features import extract_features as e;"
        f"f = e({{'messages': [{{'role': 'user', 'content': {CODE!r}}}], 'model': 'm'}}, 'chat');"
        "print(f.family, f.model, sum(f.grams))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    f = extract_features(chat(("user", CODE), model="m"), "chat")
    assert outs == {f"{f.family} {f.model} {sum(f.grams)}\n"}


def test_the_text_looked_at_is_bounded() -> None:
    huge = "alpha beta " * 200_000 + "omega tail"
    text, _ = request_text(chat(("system", huge), ("user", huge)), "chat")
    assert len(text) <= 2 * (HEAD_CHARS + TAIL_CHARS) + 64
    assert "tail" in text  # the end of the question is kept
    text, _ = request_text({"prompt": huge}, "completions")
    assert len(text) <= HEAD_CHARS + TAIL_CHARS + 1 and text.endswith("omega tail")
    assert len(text_grams(" ".join(f"w{i}" for i in range(5000)))) == MAX_GRAMS
    tools = [{"type": "function", "function": {"name": "t", "description": "d"}}] * 100_000
    f = extract_features({"messages": [{"role": "user", "content": "x"}], "tools": tools}, "chat")
    assert f.tools == 100_000


@pytest.mark.parametrize(
    ("body", "endpoint"),
    [
        ({"messages": "nope"}, "chat"),
        ({"messages": [1, None, {"role": "user", "content": [{"type": "text", "text": "hi"}, 3]}]}, "chat"),
        ({"messages": [], "temperature": "hot", "top_k": True, "n": 1e300, "tools": "x", "model": 5}, "chat"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": float("nan")}, "chat"),
        ({"prompt": [1, 2, 3]}, "completions"),
        ({"text": "hi", "sampling_params": {"temperature": 0.2, "top_k": 5}}, "generate"),
        ({"input_ids": [1, 2], "sampling_params": "no"}, "generate"),
    ],
)
def test_odd_bodies_give_features_never_an_error(body: dict[str, Any], endpoint: Any) -> None:
    f = extract_features(body, endpoint)
    assert f.temperature is None or f.temperature == 0.2
    assert f.n >= 1 and f.tools >= 0


def test_generate_reads_sampling_params_and_text() -> None:
    f = extract_features({"text": CODE, "sampling_params": {"temperature": 0.2, "top_k": 5}}, "generate")
    assert (f.temperature, f.top_k) == (0.2, 5) and f.grams and f.family


def test_prompt_chars_match_the_proxy_estimate() -> None:
    """The simulator sizes prompts as the proxy estimates them (characters / 4)."""
    bodies: list[tuple[dict[str, Any], EndpointKind]] = [
        (chat(("system", "s" * 101), ("user", [{"type": "text", "text": "t" * 57}])), "chat"),
        ({"prompt": "p" * 999}, "completions"),
    ]
    for body, endpoint in bodies:
        assert estimate_prompt_chars(body, endpoint) // 4 == estimate_prompt_tokens(body, endpoint)


def traits_of(text: str, **extra: Any) -> set[str]:
    bits = extract_features(chat(("user", text), **extra), "chat").traits
    return {name for name, bit in TRAIT_BITS.items() if bits & bit}


def test_traits_say_what_kind_of_task_the_text_is() -> None:
    """Issue 33: what lets one task type's outcomes teach its never-seen prompts."""
    assert traits_of("Explain the Nile river to a curious high-school student, with two facts.") == set()
    assert traits_of(CODE) == {"code"}
    assert "code_fence" in traits_of("Fix this:\n```js\nconst f = (x) => x + 1;\n```")
    assert "math" in traits_of("Natalia sold 48 clips in April. How many clips did she sell in all?")
    assert "math" in traits_of(r"Prove that $\frac{a}{b} \le 1$ when a <= b.")
    assert traits_of("Переведите на английский: мороз и солнце, день чудесный, ещё ты дремлешь") >= {
        "non_latin",
        "translate",
    }
    german = "Wer im Glashaus sitzt, soll nicht mit Steinen werfen, denn die Scheiben gehen sonst kaputt."
    assert "non_english" in traits_of(german)
    assert "non_english" not in traits_of(
        "Give a concise encyclopedic overview of the Byzantine Empire: its origins, its height and its fall."
    )
    doc = "Python reference.\n\n" + "The assignment statement binds names to objects. " * 80
    assert "long_doc_question" in traits_of(doc + "\n\nWhich statement is this about?")
    assert "long_doc_question" not in traits_of("Which statement is this about?")
    assert "summarize" in traits_of("TL;DR of this documentation:\n\n" + doc)
    assert "extract" in traits_of("Extract every name mentioned below as a JSON list.\n\n" + doc) >= {"json"}
    assert "json" in traits_of("hello", response_format={"type": "json_object"})
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather"}}]
    assert "tool_schema" in traits_of("What is the weather in Paris?", tools=tools)
    assert "tool_schema" in traits_of('Use this tool: {"name": "f", "parameters": {"type": "object"}}')
