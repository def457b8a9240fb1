"""Response bodies and SSE events of the emulator, in SGLang's exact shapes.

OpenAI routes (`serving_chat.py`, `serving_completions.py`): chat streams send a role chunk when a
sample's first output exists, one content chunk per output update (several tokens when the
engine ran several steps, or one EAGLE verify step, since the last read), finish chunks after
every sample has ended, then the `sglext` chunk (`return_spec_tokens_details`) and the usage
chunk (`stream_options.include_usage`). Completion chunks carry the finish reason on the chunk
of the update that ended the sample. With `n > 1` or a batch of prompts every sample has its own
`index` and id, and usage adds the samples' completion tokens (prompt tokens once per prompt).

Native `/generate` (`tokenizer_manager.py` `_handle_batch_output`): `{"text", "output_ids",
"meta_info"}` where streamed `text` and `output_ids` are cumulative; a batch (a list of prompts,
or `n > 1`) answers a list, and its streamed events carry `index`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from simulator.emulator import synthetic
from simulator.emulator.batching import EngineRequest, FinishReason
from simulator.emulator.requests import GenRequest, Logprobs


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def event(obj: Any) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


DONE = b"data: [DONE]\n\n"
FLUSH_CACHE_ANSWER = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
"""SGLang's `/flush_cache` body, with 200 and with 400 alike."""


@dataclass(eq=False)
class Sample:
    """One generated sequence of a request (a request has `n` per prompt)."""

    index: int
    req: EngineRequest
    sent: int = 0
    """Output tokens already reported to the client."""
    finish: FinishReason | None = None
    started: bool = False
    """Its first output went out (chat: the role chunk)."""
    first_sent_at: float | None = field(default=None)
    chunks: int = 0
    """Output chunks streamed so far."""
    held: str = ""
    """Text held back by an empty chunk (`empty_chunk_every`), sent with the next one."""


@dataclass(frozen=True, slots=True)
class Update:
    """What one read of the engine's events brought for one sample."""

    sample: Sample
    start: int
    """Position of the first new token."""
    new: int
    finish: FinishReason | None


# -- speculative decoding details ---------------------------------------------------------------


def spec_meta(req: EngineRequest) -> dict[str, Any]:
    """SGLang's per-request acceptance metrics (meta_info at finish; `sglext` on the OpenAI
    routes); empty before any verify step. accept_length = completion_tokens / verify_ct, as
    `_calculate_spec_decoding_metrics` computes it (the prefill's token included)."""
    verify = req.verify_ct
    if verify == 0:
        return {}
    correct = req.accepted_tokens - verify  # drafts accepted, bonus tokens excluded
    proposed = req.proposed_drafts
    return {
        "spec_accept_rate": correct / proposed if proposed else 0.0,
        "spec_accept_length": req.generated / verify,
        "spec_num_correct_drafts": correct,
        "spec_num_proposed_drafts": proposed,
        "spec_verify_ct": verify,
    }


def spec_tokens_details(meta: dict[str, Any]) -> dict[str, Any]:
    """`sglext.spec_tokens_details` (SpecTokensDetails) from the metrics of `spec_meta`."""
    return {
        "spec_accept_rate": meta.get("spec_accept_rate", 0.0),
        "spec_accept_length": meta.get("spec_accept_length", 0.0),
        "spec_cap_length": 0.0,
        "spec_block_accept_length": 0.0,
        "spec_num_correct_drafts": meta.get("spec_num_correct_drafts", 0),
        "spec_num_proposed_drafts": meta.get("spec_num_proposed_drafts", 0),
        "spec_verify_ct": meta.get("spec_verify_ct", 0),
        "spec_correct_drafts_histogram": [],
        "spec_cap_lens_histogram": [],
    }


# -- logprobs -----------------------------------------------------------------------------------


def _chat_logprobs(start: int, n: int, top: int) -> dict[str, Any]:
    """ChoiceLogprobs of output tokens `start .. start + n - 1`."""
    content = []
    for p in range(start, start + n):
        token = synthetic.text(p, 1)
        alternatives = [
            {"token": synthetic.word(t), "bytes": list(synthetic.word(t).encode()), "logprob": lp}
            for lp, t in synthetic.top_logprobs(p, top)
        ]
        content.append(
            {
                "token": token,
                "bytes": list(token.encode()),
                "logprob": synthetic.logprob(p),
                "top_logprobs": alternatives,
            }
        )
    return {"content": content}


def _completion_logprobs(start: int, n: int, top: int) -> dict[str, Any]:
    """LogProbs (legacy completions) of output tokens `start .. start + n - 1`."""
    positions = range(start, start + n)
    tops = [{synthetic.word(t): lp for lp, t in synthetic.top_logprobs(p, top)} for p in positions]
    return {
        "text_offset": [-1] * n,  # SGLang: "Not supported yet"
        "token_logprobs": [synthetic.logprob(p) for p in positions],
        "tokens": [synthetic.text(p, 1) for p in positions],
        "top_logprobs": tops if top > 0 else [],
    }


def _native_logprobs(lp: Logprobs, prompt_tokens: int, generated: int) -> dict[str, Any]:
    """meta_info logprob fields of `/generate` (`return_logprob`): [logprob, token_id, text]
    triples; input ones from `logprob_start_len` (-1: none), the first prompt token's is null."""

    def triple(value: float | None, token: int) -> list[Any]:
        return [value, token, synthetic.word(token) if lp.with_text else None]

    first_input = prompt_tokens if lp.start < 0 else min(lp.start, prompt_tokens)
    inputs = [
        triple(None if p == 0 else synthetic.logprob(p), synthetic.token_id(p))
        for p in range(first_input, prompt_tokens)
    ]
    outputs = [triple(synthetic.logprob(p), synthetic.token_id(p)) for p in range(generated)]
    meta: dict[str, Any] = {
        "input_token_logprobs": inputs,
        "output_token_logprobs": outputs,
        "output_token_logprobs_length": generated,
    }
    if lp.top > 0:
        meta["input_top_logprobs"] = [
            None if p == 0 else [triple(v, t) for v, t in synthetic.top_logprobs(p, lp.top)]
            for p in range(first_input, prompt_tokens)
        ]
        meta["output_top_logprobs"] = [
            [triple(v, t) for v, t in synthetic.top_logprobs(p, lp.top)] for p in range(generated)
        ]
    return meta


# -- OpenAI routes ------------------------------------------------------------------------------


def usage(
    g: GenRequest, samples: list[Sample], *, streamed: bool, cache_report: bool = False
) -> dict[str, Any]:
    """UsageInfo: prompt tokens once per prompt, completion tokens of every sample; with
    `cache_report` (SGLang's `--enable-cache-report`) `prompt_tokens_details` is
    `{"cached_tokens": N}` (N counted once per prompt) when N > 0, else null, as SGLang's
    UsageProcessor does."""
    completion = sum(s.sent for s in samples)
    details = None
    if cache_report:
        cached = sum(samples[i].req.cached_tokens for i in range(0, len(samples), g.n))
        details = {"cached_tokens": cached} if cached > 0 else None
    u: dict[str, Any] = {
        "prompt_tokens": g.prompt_tokens,
        "total_tokens": g.prompt_tokens + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }
    if streamed and g.kind == "completions":
        # completions dump their usage chunk with exclude_none
        del u["completion_tokens_details"]
        if details is None:
            del u["prompt_tokens_details"]
    return u


class OpenAIEvents:
    """The SSE events of one streamed chat or completions answer."""

    def __init__(
        self,
        g: GenRequest,
        eos_token_id: int,
        *,
        cache_report: bool = False,
        reasoning_tokens: int = 0,
        empty_chunk_every: int = 0,
    ) -> None:
        self.g = g
        self.eos = eos_token_id
        self.cache_report = cache_report
        self.reasoning_tokens = reasoning_tokens
        self.empty_chunk_every = empty_chunk_every
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if g.kind == "chat" else "text_completion"
        self.last_id = ""
        """Id of the sample updated last: SGLang's finish, sglext and usage chunks carry it."""

    def _event(self, rid: str, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        head = {"id": rid, "object": self.object, "created": self.created, "model": self.g.model}
        return event({**head, "choices": choices, **extra})

    def _matched(self, reason: FinishReason | None) -> int | None:
        return self.eos if reason == "stop" else None

    def _chat_choice(
        self, index: int, delta: dict[str, Any], logprobs: Any, reason: FinishReason | None
    ) -> Any:
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": reason,
            "matched_stop": self._matched(reason),
        }

    def update(self, u: Update) -> bytes:
        """Events for one sample's update (chat: role chunk first, then its content)."""
        s = u.sample
        rid = s.req.rid
        self.last_id = rid
        lp = self.g.logprobs
        out = b""
        if self.g.kind == "chat":
            if not s.started:
                delta = {"reasoning_content": None, "role": "assistant", "content": ""}
                out += self._event(rid, [self._chat_choice(s.index, delta, None, None)])
            if u.new:
                logprobs = _chat_logprobs(u.start, u.new, lp.top) if lp is not None else None
                reasoning = max(0, min(u.new, self.reasoning_tokens - u.start))
                if reasoning:  # vLLM's field: reasoning text, no content
                    delta = {"reasoning": synthetic.text(u.start, reasoning), "content": None}
                    out += self._event(rid, [self._chat_choice(s.index, delta, None, None)])
                if u.new > reasoning:
                    text = self._text(s, synthetic.text(u.start + reasoning, u.new - reasoning), u.finish)
                    delta = {"reasoning_content": None, "content": text}
                    out += self._event(rid, [self._chat_choice(s.index, delta, logprobs, None)])
        else:
            logprobs = _completion_logprobs(u.start, u.new, lp.top) if lp is not None and u.new else None
            choice = {
                "index": s.index,
                "text": self._text(s, synthetic.text(u.start, u.new), u.finish),
                "logprobs": logprobs,
                "finish_reason": u.finish,
                "matched_stop": self._matched(u.finish),
            }
            out += self._event(rid, [choice], usage=None)
        s.started = True
        return out

    def _text(self, s: Sample, text: str, finish: FinishReason | None) -> str:
        """The chunk's text: empty every `empty_chunk_every` chunks (held for the next one)."""
        s.chunks += 1
        every = self.empty_chunk_every
        if every and s.chunks % every == 0 and finish is None:
            s.held += text
            return ""
        text, s.held = s.held + text, ""
        return text

    def tail(self, finished: list[Sample], samples: list[Sample], spec: list[dict[str, Any]] | None) -> bytes:
        """After every sample ended: chat finish chunks (in the order the samples finished), the
        sglext chunk when asked for (`spec`: per sample), the usage chunk when asked for, [DONE]."""
        out = b""
        if self.g.kind == "chat":
            for s in finished:
                delta: dict[str, Any] = {"reasoning_content": None}
                if s.held:
                    delta["content"], s.held = s.held, ""
                choice = self._chat_choice(s.index, delta, None, s.finish)
                out += self._event(self.last_id, [choice])
        if spec is not None:
            details = [spec_tokens_details(m) for m in spec]
            out += self._event(
                self.last_id, [], sglext={"spec_tokens_details": details if self.g.n > 1 else details[0]}
            )
        if self.g.include_usage:
            out += self._event(
                self.last_id, [], usage=usage(self.g, samples, streamed=True, cache_report=self.cache_report)
            )
        return out + DONE


def openai_response(
    g: GenRequest,
    samples: list[Sample],
    eos_token_id: int,
    spec: list[dict[str, Any]] | None,
    *,
    cache_report: bool = False,
) -> dict[str, Any]:
    """The non-streaming chat.completion / text_completion body."""
    lp = g.logprobs
    choices = []
    for s in samples:
        text = synthetic.text(0, s.sent)
        choice: dict[str, Any]
        if g.kind == "chat":
            message = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
            choice = {"index": s.index, "message": message}
            logprobs = _chat_logprobs(0, s.sent, lp.top) if lp is not None else None
        else:
            choice = {"index": s.index, "text": text}
            logprobs = _completion_logprobs(0, s.sent, lp.top) if lp is not None else None
        choice.update(
            logprobs=logprobs,
            finish_reason=s.finish,
            matched_stop=eos_token_id if s.finish == "stop" else None,
        )
        choices.append(choice)
    body: dict[str, Any] = {
        "id": samples[0].req.rid,
        "object": "chat.completion" if g.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": g.model,
        "choices": choices,
        "usage": usage(g, samples, streamed=False, cache_report=cache_report),
        "metadata": {"weight_version": "default"},
    }
    if spec is not None:
        details = [spec_tokens_details(m) for m in spec]
        body["sglext"] = {"spec_tokens_details": details if g.n > 1 else details[0]}
    return body


# -- native /generate ---------------------------------------------------------------------------


def _finish_reason(reason: FinishReason | None, s: Sample, g: GenRequest, eos: int) -> dict[str, Any] | None:
    if reason is None:
        return None
    if reason == "stop":
        return {"type": "stop", "matched": eos}
    if reason == "length":
        return {"type": "length", "length": g.max_tokens if g.max_tokens is not None else s.sent}
    return {"type": "abort", "message": None, "status_code": None, "err_type": None}


def native_output(
    g: GenRequest, s: Sample, eos_token_id: int, spec: dict[str, Any] | None, now: float
) -> dict[str, Any]:
    """One `/generate` output of sample `s` as it stands (cumulative text and ids); at the end
    with `e2e_latency` and, on a speculative server, the acceptance metrics `spec`."""
    req = s.req
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": _finish_reason(s.finish, s, g, eos_token_id),
        "prompt_tokens": req.prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
    }
    if g.logprobs is not None:
        meta.update(_native_logprobs(g.logprobs, req.prompt_tokens, s.sent))
    meta.update(reasoning_tokens=0, completion_tokens=s.sent, cached_tokens=req.cached_tokens)
    if g.stream and s.first_sent_at is None:
        s.first_sent_at = time.time()
        meta["response_sent_to_client_ts"] = s.first_sent_at
    if s.finish is not None:
        meta["e2e_latency"] = max(0.0, now - req.submitted_at)
        if spec:
            meta.update(spec)
    out: dict[str, Any] = {
        "text": synthetic.text(0, s.sent),
        "output_ids": synthetic.token_ids(0, s.sent),
        "meta_info": meta,
    }
    if g.stream and g.batch:
        out["index"] = s.index
    return out


def native_error_event(message: str, code: int = 400) -> bytes:
    """The error event `/generate` streams (after HTTP 200) when a request fails validation."""
    err = {"message": message, "type": "invalid_request_error", "code": code, "retryable": False}
    return f"data: {json.dumps({'error': err})}\n\n".encode()


def native_queue_full_event(rid: str, prompt_tokens: int) -> bytes:
    """Queue full on a streamed `/generate`: the request's one output is an abort with status 503."""
    reason = {"type": "abort", "status_code": 503, "message": "The request queue is full."}
    meta = {
        "id": rid,
        "finish_reason": reason,
        "prompt_tokens": prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": 0,
        "cached_tokens": 0,
    }
    return event({"text": "", "output_ids": [], "meta_info": meta})


def queue_full_event() -> bytes:
    """Queue full on a streamed OpenAI route: an error event after HTTP 200."""
    err = {
        "object": "error",
        "message": "The request queue is full.",
        "type": "SERVICE_UNAVAILABLE",
        "param": None,
        "code": 503,
    }
    return f"data: {json.dumps({'error': err})}\n\n".encode()
