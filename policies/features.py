"""What a request asks, as compact features: the one extractor the proxy and the simulator share.

How it works. From the request body (the parsed JSON, as the proxy holds it) the extractor takes
the part of the prompt that says what kind of answer comes next -- the system prompt, the tool
definitions and the last user message, rendered as `policies.prefix` renders them for the prefix
index (`message_text`) -- and keeps a bounded slice of it: the first `HEAD_CHARS` and the last
`TAIL_CHARS` characters. The slice is lower-cased, split on white space, and its distinct words
and word pairs are hashed (CRC-32 of the UTF-8 bytes: stable across processes and replicas,
unlike Python's salted `hash`, and computed in C) into `RequestFeatures.grams`; the prompt's
family is a blake2b hash of the system prompt's first `FAMILY_CHARS` characters (no system
prompt: of the first line of the first message, or of the prompt). Sampling parameters,
`response_format.type`, the number of tools, `n` and the model name are copied as numbers.

The policy sees only these numbers, never the text. Cost: bounded by the slice, not by the
prompt, whatever the prompt's length (`benchmarks/proxy_overhead.py`, "features" rows). Pure: no
I/O, no clock.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping
from hashlib import blake2b
from itertools import pairwise
from typing import Any

from policies.base import EndpointKind, RequestFeatures
from policies.prefix import content_text, message_text

HEAD_CHARS = 512
"""Characters kept from the start of the rendered text (system prompt, tools, then the task)."""
TAIL_CHARS = 256
"""Characters kept from its end (the end of the last user message: the question itself)."""
FAMILY_CHARS = 256
MAX_TOOLS = 64
"""Tool definitions looked at (their count is `RequestFeatures.tools` however many are sent)."""
MAX_GRAMS = 256
"""At most this many gram ids (the smallest ids: a deterministic subset)."""


TRAITS = (
    "code_fence",
    "code",
    "math",
    "non_latin",
    "non_english",
    "long_doc_question",
    "translate",
    "summarize",
    "extract",
    "json",
    "tool_schema",
)
"""`RequestFeatures.traits`: bit i set when the request has trait TRAITS[i]."""
TRAIT_BITS = {name: 1 << i for i, name in enumerate(TRAITS)}
LONG_DOC_CHARS = 2500
"""A prompt this long (characters) whose last paragraph is short is a document with a question."""
SHORT_QUESTION_CHARS = 400

# each pattern starts with a literal, so `re` finds its candidates with a fast substring scan
_CODE = tuple(re.compile(p) for p in (r"def \w+\(", r"class \w+[(:]", r"import \w+", r"function ?\w* ?\("))
_CODE_MARKS = ("#include", "=>", ";\n", "{\n", "};")
_MATH = tuple(re.compile(p) for p in (r"\\(?:frac|sqrt|sum|int|cdot|times|pi)\b", r"\$[^$\n]{1,80}\$"))
_MATH_MARKS = ("≤", "≥", "∑", "∫", "√", "π", "×", "÷")
_DIGIT = re.compile(r"\d")
_LETTER = re.compile(r"[^\W\d_]")
_NON_LATIN = re.compile(r"[^\W\d_\u0000-\u024f]")
_ACCENTED = re.compile(r"[äöüßéèêàâçñìòùíóúåøæœ]")
_WORD_MATH = (
    "how many",
    "how much",
    "how long",
    "how far",
    "calculat",
    "compute",
    "solve",
    "percent",
    "average",
)
_INSTRUCTIONS = {
    "translate": ("translat", "tradu", "übersetz", "перевед", "翻译", "翻訳"),
    "summarize": ("summar", "tl;dr", "tldr", "key points", "résum", "zusammenfass"),
    "extract": ("extract", "list all", "list every", "list each", "find all", "find every", "pull out"),
}
_SCHEMA = ('"type":', '"properties":', '"parameters":')
_ENGLISH = frozenset(
    "the and of to is are for with that this it be by at from what how which you your we does not can".split()
)


def text_traits(text: str, prompt_chars: int, tools: int) -> int:
    """`RequestFeatures.traits` of a bounded slice of the prompt (see the module docstring);
    `prompt_chars`: the whole prompt's length. Substring tests and a few C-level regex scans: a
    few microseconds on the slice."""
    bits = 0
    low = text.lower()
    if "```" in text:
        bits |= TRAIT_BITS["code_fence"]
    if any(k in text for k in _CODE_MARKS) or any(p.search(text) for p in _CODE):
        bits |= TRAIT_BITS["code"]
    if (
        any(k in text for k in _MATH_MARKS)
        or any(p.search(text) for p in _MATH)
        or (any(k in low for k in _WORD_MATH) and _DIGIT.search(text))
    ):
        bits |= TRAIT_BITS["math"]
    if not bits & (TRAIT_BITS["code"] | TRAIT_BITS["code_fence"]):
        if not text.isascii() and len(_NON_LATIN.findall(text)) * 3 > len(_LETTER.findall(text)):
            bits |= TRAIT_BITS["non_latin"]
        else:
            words = low.split()
            if len(words) >= 12:
                english = sum(map(_ENGLISH.__contains__, words))
                accented = 0 if text.isascii() else len(_ACCENTED.findall(low))
                if english * 10 < len(words) or accented * 50 > len(text):
                    bits |= TRAIT_BITS["non_english"]
    if prompt_chars >= LONG_DOC_CHARS and len(text.rstrip().rsplit("\n\n", 1)[-1]) <= SHORT_QUESTION_CHARS:
        bits |= TRAIT_BITS["long_doc_question"]
    for name, keys in _INSTRUCTIONS.items():
        if any(k in low for k in keys):
            bits |= TRAIT_BITS[name]
    if "json" in low:
        bits |= TRAIT_BITS["json"]
    if tools or any(k in text for k in _SCHEMA):
        bits |= TRAIT_BITS["tool_schema"]
    return bits


def stable_hash(text: str) -> int:
    """A stable 64-bit hash of `text` (blake2b), never 0."""
    digest = blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _tools_text(tools: Any) -> str:
    """Tool names and descriptions, in order (what a tool-calling answer will quote)."""
    if not isinstance(tools, list):
        return ""
    parts: list[str] = []
    for tool in tools[:MAX_TOOLS]:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict):
            name, desc = fn.get("name"), fn.get("description")
            parts.append(f"{name if isinstance(name, str) else ''} {desc if isinstance(desc, str) else ''}\n")
    return "<|tools|>\n" + "".join(parts) if parts else ""


def _prompt_string(prompt: Any) -> str:
    """A completions `prompt` / `/generate` `text`: a string, or a batch's first string."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    return ""


def request_text(body: Mapping[str, Any], endpoint: EndpointKind) -> tuple[str, str]:
    """(text the features are taken from, text the family is named by), both bounded.

    Chat: the system messages, the tool definitions, then the last user message; completions and
    `/generate`: the prompt. Long parts are cut before they are joined, so the cost does not grow
    with the prompt."""
    if endpoint != "chat":
        prompt = _prompt_string(body.get("prompt") if endpoint == "completions" else body.get("text"))
        if len(prompt) > HEAD_CHARS + TAIL_CHARS:
            prompt = prompt[:HEAD_CHARS] + "\n" + prompt[-TAIL_CHARS:]
        first = prompt[:FAMILY_CHARS].split("\n", 1)[0]
        return prompt, first
    messages = body.get("messages")
    if not isinstance(messages, list):
        return "", ""
    system: list[str] = []
    last: Any = None
    first_line = ""
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if role in ("system", "developer"):
            if sum(map(len, system)) < HEAD_CHARS:
                system.append(message_text(str(role), m.get("content"))[: HEAD_CHARS + 16])
        elif role == "user":
            last = m.get("content")
            if not first_line:
                first_line = content_text(last)[:FAMILY_CHARS].split("\n", 1)[0].strip()
    head = "".join(system)
    family = head[:FAMILY_CHARS] if head else first_line
    head += _tools_text(body.get("tools"))
    if last is not None:
        user = content_text(last)
        if len(user) > HEAD_CHARS + TAIL_CHARS:
            user = user[:HEAD_CHARS] + "\n" + user[-TAIL_CHARS:]
        head += f"<|user|>\n{user}\n"
    if len(head) > HEAD_CHARS + TAIL_CHARS:
        head = head[:HEAD_CHARS] + "\n" + head[-TAIL_CHARS:]
    return head, family


def text_grams(text: str) -> tuple[int, ...]:
    """The sorted distinct CRC-32 ids of the words and word pairs of `text` (lower-cased, split on
    white space), at most MAX_GRAMS (the smallest)."""
    words = text.encode("utf-8", errors="surrogatepass").lower().split()
    grams = set(words)
    grams.update(map(b" ".join, pairwise(words)))
    ids = sorted(map(zlib.crc32, grams))
    return tuple(ids[:MAX_GRAMS])


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def extract_features(body: Mapping[str, Any], endpoint: EndpointKind) -> RequestFeatures:
    """The features of one request body (see the module docstring). Never raises on odd input:
    a field of the wrong type counts as absent."""
    text, family = request_text(body, endpoint)
    params: Mapping[str, Any] = body
    if endpoint == "generate":
        sampling = body.get("sampling_params")
        params = sampling if isinstance(sampling, dict) else {}
    top_k = _number(params.get("top_k"))
    rf = body.get("response_format")
    rf_type = rf.get("type") if isinstance(rf, dict) else None
    tools = body.get("tools")
    n = _number(params.get("n"))
    model = body.get("model")
    n_tools = len(tools) if isinstance(tools, list) else 0
    rf_json = isinstance(rf_type, str) and rf_type.startswith("json")
    traits = text_traits(text, estimate_prompt_chars(body, endpoint), n_tools) if text else 0
    if rf_json:
        traits |= TRAIT_BITS["json"]
    return RequestFeatures(
        family=stable_hash(family) if family else 0,
        grams=text_grams(text) if text else (),
        temperature=_number(params.get("temperature")),
        top_p=_number(params.get("top_p")),
        top_k=None if top_k is None else int(top_k),
        response_format=rf_type[:40] if isinstance(rf_type, str) else None,
        tools=n_tools,
        n=int(n) if n is not None and 1 <= n < 2**31 else 1,
        model=stable_hash(model) if isinstance(model, str) and model else 0,
        traits=traits,
    )


def estimate_prompt_chars(body: Mapping[str, Any], endpoint: EndpointKind) -> int:
    """Characters of a chat or completions prompt as the proxy counts them for its token estimate
    (`controller.proxy.forward.estimate_prompt_tokens`: characters / 4): the simulator's prompts
    workload sizes its prompts with it."""
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(len(content_text(m.get("content"))) for m in messages if isinstance(m, dict))
    return len(_prompt_string(body.get("prompt")))
