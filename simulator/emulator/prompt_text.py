"""The canonical text of a prompt, which the emulator's prefix cache hashes in blocks.

The same rendering as specroute's proxy uses for its prefix index (`controller.proxy.prefixes`;
`tests/test_prefix_cache.py` checks that the two agree), so the proxy's belief about a
backend's cache and the emulator's cache name the same blocks:

- chat: every message as `<|ROLE|>\\nTEXT\\n` (TEXT: a string content, or the text parts of a
  list content joined), in order; the generation prompt is not part of it, so the next turn
  (these messages, the answer as an assistant message, a new user message) starts with it;
- completions and `/generate`: the prompt text as it is;
- token ids: four characters per id (`ids_text`), so blocks hold the same number of tokens
  as blocks of text (four characters per token).

A finished request's whole sequence -- what a follow-up turn resends -- is its prompt text
followed by its answer rendered the same way (`sequence_text`).
"""

from __future__ import annotations

from typing import Any

from simulator.emulator import synthetic


def content_text(content: Any) -> str:
    """The text of a message's content (a string, or the text parts of a list)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def message_text(role: str, content: Any) -> str:
    return f"<|{role}|>\n{content_text(content)}\n"


def chat_text(messages: Any) -> str:
    """The messages in order (entries that are not objects are left out; not a list: "")."""
    if not isinstance(messages, list):
        return ""
    return "".join(
        message_text(str(m.get("role")), m.get("content")) for m in messages if isinstance(m, dict)
    )


def ids_text(ids: list[int]) -> str:
    """Four characters per token id: its low 32 bits, big-endian, a byte per character."""
    return b"".join((t & 0xFFFFFFFF).to_bytes(4, "big") for t in ids).decode("latin-1")


def sequence_text(chat: bool, prompt_text: str, ids_prompt: bool, generated: int) -> str:
    """The prompt followed by the first `generated` output tokens, as a follow-up resends them."""
    if ids_prompt:
        return prompt_text + ids_text(synthetic.token_ids(0, generated))
    answer = synthetic.text(0, generated)
    if chat:
        return prompt_text + message_text("assistant", answer)
    return prompt_text + answer
