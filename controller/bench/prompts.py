"""Prompt sets for `specroute bench`: the built-in `coding` and `general` sets, or a user's
JSONL file with one `{"messages": [...]}` or `{"prompt": "..."}` object per line.

Acceptance of a speculative drafter depends on the prompt domain, so the set used is
recorded in every result; `coding` (code and agentic tasks) is the default because EAGLE-3
drafters are trained on such data.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from policies.jsonl import read_jsonl

BUILTIN_DIR = Path(__file__).parent / "prompt_sets"
BUILTIN_SETS = ("coding", "general")

Endpoint = Literal["chat", "completions"]


class PromptError(ValueError):
    """A prompt file that cannot be used; the message names the file and the line."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: chat messages, or a plain completion prompt."""

    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None
    category: str | None = None
    """The line's `category` (e.g. "code"): bench reports acceptance and speed per category."""

    def body(self, endpoint: Endpoint) -> dict[str, Any]:
        """The request fields carrying this prompt for `endpoint`."""
        if endpoint == "chat":
            if self.messages is not None:
                return {"messages": [dict(m) for m in self.messages]}
            return {"messages": [{"role": "user", "content": self.prompt or ""}]}
        if self.prompt is not None:
            return {"prompt": self.prompt}
        return {"prompt": "\n\n".join(m["content"] for m in self.messages or ())}


@dataclass(frozen=True)
class PromptSet:
    name: str
    """Built-in set name, or the file path given by the user."""
    prompts: tuple[Prompt, ...]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def categorized(self) -> bool:
        """Some prompt has a `category` (bench then asks for per-request acceptance)."""
        return any(p.category is not None for p in self.prompts)

    def pick(self, index: int) -> Prompt:
        """Prompts in order, wrapping around: concurrent requests get distinct prompts as
        long as the set is at least as large as the concurrency."""
        return self.prompts[index % len(self.prompts)]


def _parse_line(obj: Any, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise PromptError(f"{where}: expected a JSON object with 'messages' or 'prompt'")
    category = obj.get("category")
    if category is not None and (not isinstance(category, str) or not 0 < len(category) <= 64):
        raise PromptError(f"{where}: 'category' must be a string of 1 to 64 characters")
    return replace(_parse_prompt(obj, where), category=category)


def _parse_prompt(obj: dict[str, Any], where: str) -> Prompt:
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise PromptError(f"{where}: 'messages' must be a non-empty list")
        parsed: list[dict[str, str]] = []
        for i, m in enumerate(msgs):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise PromptError(f"{where}: messages[{i}] needs string 'role' and 'content'")
            parsed.append({"role": m["role"], "content": m["content"]})
        return Prompt(messages=tuple(parsed))
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise PromptError(f"{where}: 'prompt' must be a non-empty string")
        return Prompt(prompt=obj["prompt"])
    raise PromptError(f"{where}: expected a 'messages' or 'prompt' key")


def load_prompt_file(path: str | Path, name: str | None = None) -> PromptSet:
    prompts = [_parse_line(obj, where) for where, obj in read_jsonl(path, what="prompts", error=PromptError)]
    if not prompts:
        raise PromptError(f"{path}: no prompts in file")
    return PromptSet(name=name or str(path), prompts=tuple(prompts))


def load_prompts(name_or_path: str | Path) -> PromptSet:
    """A built-in set by name (`coding`, `general`) or a JSONL file by path."""
    if str(name_or_path) in BUILTIN_SETS:
        return load_prompt_file(BUILTIN_DIR / f"{name_or_path}.jsonl", name=str(name_or_path))
    p = Path(name_or_path)
    if not p.exists() and len(p.parts) == 1 and p.suffix == "":
        raise PromptError(
            f"no built-in prompt set {str(name_or_path)!r} (known: {', '.join(BUILTIN_SETS)}) "
            "and no such file"
        )
    return load_prompt_file(p)
