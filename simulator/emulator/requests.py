"""Parsing generation requests the way SGLang judges them (`serving_chat.py`,
`serving_completions.py`, `io_struct.py` GenerateReqInput, the `/generate` contract).

A request becomes a `GenRequest`: its prompts (one, or a batch), `n` samples per prompt,
the output budget and the options that change the answer's shape (streaming, usage chunk,
logprobs, spec details). Errors carry how SGLang reports them: `BadRequest` (a flat 400 on the
OpenAI routes), `ContractError` (`/generate`'s schema check: 400 `{"error": "..."}`) and
`GenerateError` (`/generate`'s semantic errors, raised where SGLang raises ValueError: 400
`{"error": {"message": ...}}`, or an error event when streaming).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from policies.prefix import chat_text, ids_text

Kind = Literal["chat", "completions", "generate"]
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's SamplingParams default when `/generate` sets no max_new_tokens."""


class BadRequest(Exception):
    """An OpenAI-route request SGLang refuses with its flat 400 error body."""


class ContractError(Exception):
    """A `/generate` body that breaks SGLang's JSON contract (wrong shape or type)."""


class GenerateError(Exception):
    """A `/generate` request SGLang refuses after parsing (no prompt, too long, ...)."""


@dataclass(frozen=True, slots=True)
class Logprobs:
    """What logprobs a request asked for."""

    top: int = 0
    """Alternatives per position (OpenAI `top_logprobs` / completions `logprobs`, `/generate`
    `top_logprobs_num`)."""
    start: int = -1
    """`/generate` `logprob_start_len`: first prompt position with input logprobs (-1: none)."""
    with_text: bool = True
    """`/generate` `return_text_in_logprobs` (the OpenAI routes always want text)."""


@dataclass(frozen=True, slots=True)
class GenRequest:
    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    ignore_eos: bool
    prompts: tuple[int, ...]
    """Prompt tokens of each prompt (more than one: a batch)."""
    rid: str | None
    n: int = 1
    """Samples per prompt."""
    batch: bool = False
    """The client sent a list of prompts (`/generate` then answers with a list)."""
    spec_details: bool = False
    logprobs: Logprobs | None = None
    texts: tuple[str, ...] = ()
    """Canonical text of each prompt (`policies.prefix` renders it), which the prefix cache hashes; empty:
    nothing is cached."""
    ids_prompt: bool = False
    """The prompts are token ids (their answers are cached as ids too)."""
    temperature: float | None = None
    """Sampling temperature as sent (None: not a number, or not sent); acceptance rules use it."""

    @property
    def samples(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, index: int) -> int:
        """Prompt tokens of sample `index` (SGLang orders samples prompt by prompt)."""
        return self.prompts[index // self.n]

    def text_of(self, index: int) -> str:
        """Canonical text of sample `index`'s prompt ("" when unknown)."""
        i = index // self.n
        return self.texts[i] if i < len(self.texts) else ""

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens counted once per prompt (what usage reports)."""
        return sum(self.prompts)

    @property
    def longest_prompt(self) -> int:
        return max(self.prompts)


def _tokens_of_text(text: str) -> int:
    return math.ceil(len(text) / 4)


def _chat_prompt_tokens(messages: Any) -> int:
    if not isinstance(messages, list):
        raise BadRequest("'messages' must be a list")
    if not messages:
        raise BadRequest("Messages cannot be empty.")
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, str):
            total += _tokens_of_text(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += _tokens_of_text(part["text"])
        elif content is not None:
            raise BadRequest(f"messages[{i}].content must be a string, a list of parts or null")
        total += 4  # chat template overhead per message
    return total


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


Prompts = tuple[tuple[int, ...], bool, tuple[str, ...], bool]
"""(prompt tokens per prompt, is a batch, canonical text per prompt, the prompts are ids)."""


def _completion_prompts(prompt: Any) -> Prompts:
    """The prompts of an OpenAI completions `prompt`."""
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("Prompt cannot be empty")
        return (_tokens_of_text(prompt),), False, (prompt,), False
    if isinstance(prompt, list) and prompt:
        if _is_ids(prompt):
            return (len(prompt),), False, (ids_text(prompt),), True
        if all(isinstance(p, str) for p in prompt):
            if all(not p for p in prompt):
                raise BadRequest("Prompt cannot be empty")
            return tuple(max(1, _tokens_of_text(p)) for p in prompt), len(prompt) > 1, tuple(prompt), False
        if all(_is_ids(p) and p for p in prompt):
            texts = tuple(ids_text(p) for p in prompt)
            return tuple(len(p) for p in prompt), len(prompt) > 1, texts, True
    if isinstance(prompt, list) and not prompt:
        raise BadRequest("Prompt cannot be empty")
    raise BadRequest("'prompt' must be a string, a list of strings, or token ids (a list or a list of lists)")


def _opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise BadRequest(f"'{key}' must be an integer >= {minimum}")
    return v


def _model(body: dict[str, Any], default_model: str) -> str:
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    if ":" in model:
        base, adapter = model.split(":", 1)
        raise BadRequest(f"model {model!r} selects LoRA adapter {adapter!r} of {base!r}, but LoRA is off")
    return model


def _openai_logprobs(body: dict[str, Any], kind: Kind) -> Logprobs | None:
    if kind == "chat":
        wanted = body.get("logprobs", False)
        if not isinstance(wanted, bool):
            raise BadRequest("'logprobs' must be a boolean")
        top = _opt_int(body, "top_logprobs", 0) or 0
        return Logprobs(top=top) if wanted else None
    top_n = _opt_int(body, "logprobs", 0)
    return None if top_n is None else Logprobs(top=top_n)


def parse_openai(body: Any, kind: Kind, default_model: str) -> GenRequest:
    """An OpenAI-route (`chat` or `completions`) request; BadRequest as SGLang refuses it."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = _model(body, default_model)
    prompts: tuple[int, ...]
    texts: tuple[str, ...]
    if kind == "chat":
        messages = body.get("messages")
        prompts, batch = (_chat_prompt_tokens(messages),), False
        texts, ids_prompt = (chat_text(messages),), False
        max_tokens = _opt_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens", 1)
    else:
        prompts, batch, texts, ids_prompt = _completion_prompts(body.get("prompt"))
        max_tokens = _opt_int(body, "max_tokens", 1)
    n = _opt_int(body, "n", 1) or 1
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("'rid' must be a string")
    return GenRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        max_tokens=max_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        prompts=prompts,
        rid=rid,
        n=n,
        batch=batch,
        spec_details=bool(body.get("return_spec_tokens_details")),
        logprobs=_openai_logprobs(body, kind),
        texts=texts,
        ids_prompt=ids_prompt,
        temperature=_temperature(body.get("temperature")),
    )


def _temperature(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


# -- /generate ------------------------------------------------------------------------------


def _contract_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ContractError(f"{name}: expected an integer, got {type(value).__name__}")
    return value


def _contract_bool(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ContractError(f"{name}: expected a boolean, got {type(value).__name__}")
    return value


def _generate_prompts(body: dict[str, Any]) -> Prompts:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None:
        if isinstance(text, str):
            return (max(1, _tokens_of_text(text)),), False, (text,), False
        if isinstance(text, list) and all(isinstance(t, str) for t in text):
            if not text:
                raise GenerateError("text cannot be an empty batch.")
            return tuple(max(1, _tokens_of_text(t)) for t in text), True, tuple(text), False
        raise ContractError("text: expected a string or a list of strings")
    if ids is not None:
        if _is_ids(ids):
            if not ids:
                raise GenerateError("input_ids cannot be empty.")
            return (len(ids),), False, (ids_text(ids),), True
        if isinstance(ids, list) and all(_is_ids(p) for p in ids):
            if any(not p for p in ids):
                raise GenerateError("input_ids cannot be empty.")
            return tuple(len(p) for p in ids), True, tuple(ids_text(p) for p in ids), True
        raise ContractError("input_ids: expected a list of integers or a list of lists of integers")
    raise GenerateError("Either text, input_ids or input_embeds should be provided.")


def parse_generate(body: Any) -> GenRequest:
    """A native `/generate` request (GenerateReqInput); ContractError / GenerateError as SGLang
    reports them. One `sampling_params` object applies to every prompt of a batch."""
    if not isinstance(body, dict):
        raise ContractError("GenerateRequest: expected a JSON object")
    stream = _contract_bool(body.get("stream"), "stream")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise ContractError("rid: the emulator takes one string rid per request")
    params = body.get("sampling_params")
    if params is None:
        params = {}
    if isinstance(params, list):
        raise ContractError("sampling_params: the emulator takes one object for the whole request")
    if not isinstance(params, dict):
        raise ContractError("sampling_params: expected an object")
    prompts, batch, texts, ids_prompt = _generate_prompts(body)
    max_new = params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
    max_tokens = _contract_int(max_new, "sampling_params.max_new_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise GenerateError(f"max_new_tokens must be at least 1 in the emulator, got {max_tokens}.")
    n = _contract_int(params.get("n"), "sampling_params.n") or 1
    if n < 1:
        raise GenerateError(f"n must be at least 1, got {n}.")
    logprobs = None
    if _contract_bool(body.get("return_logprob"), "return_logprob"):
        start = _contract_int(body.get("logprob_start_len"), "logprob_start_len")
        top = _contract_int(body.get("top_logprobs_num"), "top_logprobs_num")
        with_text = _contract_bool(body.get("return_text_in_logprobs"), "return_text_in_logprobs")
        logprobs = Logprobs(top=top or 0, start=-1 if start is None else start, with_text=with_text)
    return GenRequest(
        kind="generate",
        model="",
        stream=stream,
        include_usage=False,
        max_tokens=max_tokens,
        ignore_eos=bool(params.get("ignore_eos", False)),
        prompts=prompts,
        rid=rid,
        n=n,
        batch=batch or n > 1,
        logprobs=logprobs,
        texts=texts,
        ids_prompt=ids_prompt,
        temperature=_temperature(params.get("temperature")),
    )


def context_error(g: GenRequest, max_model_len: int) -> str | None:
    """SGLang's TokenizerManager._validate_one_request wording, or None when the request fits."""
    prompt = g.longest_prompt
    if prompt >= max_model_len:
        return (
            f"The input ({prompt} tokens) is longer than the model's context length ({max_model_len} tokens)."
        )
    if g.max_tokens is not None and prompt + g.max_tokens > max_model_len:
        total = prompt + g.max_tokens
        return (
            f"Requested token count exceeds the model's maximum context length of {max_model_len} "
            f"tokens. You requested a total of {total} tokens: {prompt} tokens from the input "
            f"messages and {g.max_tokens} tokens for the completion. Please reduce the number of "
            "tokens in the input messages or the completion to fit within the limit."
        )
    return None
