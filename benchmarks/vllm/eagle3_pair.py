"""Build a trained tiny Llama target and two EAGLE-3 heads for it, for vLLM's CPU build: the real
speculative engine of `tests/vllm/` and `benchmarks/vllm/`.

What it builds, all from a seed, a fixed number of optimizer steps and nothing downloaded:
- `target/`: a byte-level BPE (`tiny_model.train_tokenizer`) and the tiny Llama of
  `tiny_model.llama_config` trained on chat turns of two domains, code and prose
  (`benchmarks/vllm/domains.py`), its end-of-sequence row zeroed afterwards (`never_ends`);
- `eagle3-code/`: an EAGLE-3 head trained on the target's greedy continuations of code prompts
  only, as a production drafter trained on code and agentic data: vLLM accepts most of its
  drafts on code and almost none on prose;
- `eagle3-mixed/`: the control, the same head trained on code and prose alike.

The head is vLLM's `Eagle3LlamaForCausalLM` (`vllm/model_executor/models/llama_eagle3.py`): `fc`
maps the target's hidden states at the layers `AUX_LAYERS` (the residual stream entering them:
HF's `hidden_states[L]`, vLLM's auxiliary outputs) to one hidden state; one decoder layer whose
q/k/v read the normed token embedding beside the normed hidden state (`hidden_norm`); `norm`;
its own `lm_head` over the full vocabulary (no `d2t`); the target's embedding shared (none in
the checkpoint). Trained as EAGLE-3 trains ("training-time test"): draft step s of the chain
that starts at position i reads the token at i+s+1 and the head's own output of step s-1, and
attends to the step-0 keys up to i and to its chain's own keys, exactly what vLLM's proposer
computes after a verify step; the labels are the target's greedy tokens. The same chain
computation estimates vLLM's acceptance offline (`acceptance`).

Checks, each a failed build when it does not hold (`CHECKS`): the target's greedy continuations
of held-out prompts are not degenerate (distinct tokens per domain and per continuation), and
the offline accept length at k=2 is high on code and near 1 on prose for the code head, high on
both for the mixed head. Their figures go into `report.json`.

Deterministic: seeded, step-limited, `torch.use_deterministic_algorithms`, a fixed thread
count; the same versions on the same machine build the same bytes. The result is cached under
`--cache` (default `$XDG_CACHE_HOME/specroute`, else `~/.cache/specroute`) in a folder named by
a digest of this file, `domains.py`, `tiny_model.py`, the generator `domains.py` uses
(`controller/bench/domain_prompts.py`), the library versions and the machine, so a second run is
free. Run it in the environment that has vLLM (torch, transformers, tokenizers):

    python benchmarks/vllm/eagle3_pair.py                 # prints the folder on its last line

The files it writes (about 30 MB) are build output: never commit them. A failed check leaves
nothing in the cache; its figures are printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import domains
import tiny_model

SEED = 0
VOCAB_SIZE = 2048
THREADS = 2
"""torch's intra-op threads, fixed: a reduction split another way rounds differently."""
AUX_LAYERS = (1, 2, 3)
"""The target layers whose input the head reads (set explicitly in its config: vLLM's default
(2, n // 2, n - 3) names only two distinct layers of a 4-layer target)."""

TARGET_DOCS = 2400
"""Training documents per domain."""
TARGET_STEPS = 120
TARGET_BATCH, TARGET_SEQ = 16, 256
"""Sequences per step and tokens per sequence (4,096 tokens a step)."""
TARGET_LR = 3e-3

HEAD_PROMPTS = 96
"""Prompts per domain whose greedy continuations the heads train on."""
HEAD_STEPS = 100
HEAD_BATCH = 16
HEAD_LR = 2e-3
CHAIN_STEPS = 3
"""Draft steps trained (vLLM is run with k=2; a third keeps k=3 usable)."""
GENERATE_TOKENS = 96
"""Greedy tokens generated per prompt for the heads and the checks."""

CHECK_PROMPTS = 24
"""Held-out prompts per domain for the checks."""
CHECK_TOKENS = 64
CHECK_K = 2
CHECKS = {
    # a target that loops on a token or two, as an under-trained one does, uses a handful; this one
    # uses ~70 per domain and 36-45 in each 64-token continuation
    "min_distinct_tokens_per_domain": 40,
    "min_distinct_tokens_per_continuation": 16,
    "code_head_min_accept_code": 2.4,
    "code_head_max_accept_prose": 1.3,
    "mixed_head_min_accept": 2.2,
}
"""What the build must show on the held-out prompts (accept lengths offline, at k=2)."""

HEADS = {"code": ("code",), "mixed": ("code", "prose")}
"""Each head's training domains."""


# -- the cache --


def digest() -> str:
    """What the build depends on: its sources, the library versions and the machine."""
    import safetensors
    import tokenizers
    import torch
    import transformers

    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in ("eagle3_pair.py", "domains.py", "tiny_model.py", "../../controller/bench/domain_prompts.py"):
        h.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    versions = [torch.__version__, transformers.__version__, tokenizers.__version__, safetensors.__version__]
    h.update(json.dumps([*versions, platform.python_version(), platform.machine()]).encode())
    return h.hexdigest()[:16]


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specroute"


def ensure(cache: Path, log: Any = None) -> Path:
    """The built folder under `cache`, built first when it is not there. One builder at a time
    (a lock file beside it: a second caller waits for the first and finds its build), into a
    temporary folder renamed into place, so a reader never sees half a build."""
    import fcntl

    name = f"eagle3-pair-{digest()}"
    out = cache / name
    if (out / "report.json").exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "report.json").exists():
            return out
        for stale in cache.glob(f"{name}.building-*"):  # an interrupted build's: the lock holder builds
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f"{name}.building-", dir=cache))
        try:
            build(work, log or (lambda msg: print(msg, file=sys.stderr, flush=True)))
            work.rename(out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


# -- text --


def render(prompt: str, answer: str = "") -> str:
    """A chat turn as the tiny model's chat template renders it (`tiny_model.CHAT_TEMPLATE`)."""
    return f"{tiny_model.SPECIALS[0]}user: {prompt}\nassistant: {answer}"


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# -- the target --


def train_target(tokenizer: Any, log: Any) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    rng = random.Random(SEED)
    docs = [d for domain in domains.DOMAINS for d in domains.documents(domain, "target", TARGET_DOCS, SEED)]
    rng.shuffle(docs)
    stream: list[int] = []
    for d in docs:
        # the prompt's tokens as vLLM makes them (the rendered chat turn alone: it ends with
        # "assistant: "), then the answer's: across that boundary BPE would merge differently
        stream += encode(tokenizer, render(d.prompt)) + encode(tokenizer, d.answer + tiny_model.SPECIALS[1])
    chunks = torch.tensor(stream[: len(stream) // TARGET_SEQ * TARGET_SEQ]).view(-1, TARGET_SEQ)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(tiny_model.llama_config(tokenizer))
    opt = torch.optim.AdamW(model.parameters(), lr=TARGET_LR, betas=(0.9, 0.95), weight_decay=0.01)
    order = list(range(len(chunks)))
    log(f"target: {len(stream)} tokens in {len(chunks)} sequences, {TARGET_STEPS} steps")
    model.train()
    for step in range(TARGET_STEPS):
        if step * TARGET_BATCH % len(order) < TARGET_BATCH:
            rng.shuffle(order)
        at = step * TARGET_BATCH % len(order)
        batch = chunks[order[at : at + TARGET_BATCH]]
        for group in opt.param_groups:
            group["lr"] = schedule(step, TARGET_STEPS, TARGET_LR)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == TARGET_STEPS - 1:
            log(f"target step {step}: loss {loss.item():.3f}")
    model.eval()
    tiny_model.never_ends(model, tokenizer)
    return model


def schedule(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10 steps, then cosine down to a tenth of the peak."""
    if step < 10:
        return peak * (step + 1) / 10
    progress = (step - 10) / max(1, steps - 10)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def greedy(model: Any, tokenizer: Any, prompts: Sequence[str], tokens: int) -> list[tuple[list[int], int]]:
    """Each prompt's token ids followed by the target's `tokens` greedy tokens, and the prompt's
    length."""
    import torch

    out = []
    for at in range(0, len(prompts), 32):
        ids = [encode(tokenizer, render(p)) for p in prompts[at : at + 32]]
        width = max(len(x) for x in ids)
        pad = tokenizer.pad_token_id
        batch = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            gen = model.generate(
                input_ids=batch, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                do_sample=False, pad_token_id=pad,
            )  # fmt: skip
        for x, row in zip(ids, gen.tolist(), strict=True):
            out.append((x + row[width:], len(x)))
    return out


def target_view(model: Any, seqs: Sequence[list[int]], pad: int) -> list[tuple[Any, Any]]:
    """Per sequence, the target's auxiliary hidden states [T, 3H] and greedy next tokens [T]."""
    import torch

    out = []
    for at in range(0, len(seqs), 32):
        group = seqs[at : at + 32]
        width = max(len(s) for s in group)
        batch = torch.tensor([s + [pad] * (width - len(s)) for s in group])
        with torch.no_grad():
            res = model(input_ids=batch, output_hidden_states=True)
        aux = torch.cat([res.hidden_states[layer] for layer in AUX_LAYERS], dim=-1)
        best = res.logits.argmax(-1)
        for i, s in enumerate(group):
            out.append((aux[i, : len(s)].clone(), best[i, : len(s)].clone()))
    return out


# -- the head --


def head_module(config: Any, target: Any) -> Any:
    """vLLM's EAGLE-3 Llama head as a torch module, its parameters named as in the checkpoint."""
    import torch
    from torch import nn

    hidden, inter = config.hidden_size, config.intermediate_size
    eps = config.rms_norm_eps

    class Norm(nn.Module):  # type: ignore[misc]  # torch is not in specroute's environment
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden))

        def forward(self, x: Any) -> Any:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def linear(i: int, o: int) -> Any:
        return nn.Linear(i, o, bias=False)

    class Layer(nn.Module):  # type: ignore[misc]  # torch is not in specroute's environment
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm, self.hidden_norm, self.post_attention_layernorm = Norm(), Norm(), Norm()
            self.self_attn = nn.Module()
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(self.self_attn, name, linear(2 * hidden, hidden))
            self.self_attn.o_proj = linear(hidden, hidden)
            self.mlp = nn.Module()
            self.mlp.gate_proj, self.mlp.up_proj = linear(hidden, inter), linear(hidden, inter)
            self.mlp.down_proj = linear(inter, hidden)

    class Head(nn.Module):  # type: ignore[misc]  # torch is not in specroute's environment
        def __init__(self) -> None:
            super().__init__()
            self.fc = linear(len(AUX_LAYERS) * hidden, hidden)
            self.midlayer = Layer()
            self.norm = Norm()
            self.lm_head = linear(hidden, config.vocab_size)

    head = Head()
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight)
        head.norm.weight.copy_(target.model.norm.weight)
    return head


def rope(x: Any, positions: Any, theta: float) -> Any:
    """Rotary embedding of [B, heads, A, d] at `positions` [A], vLLM's (and HF's) neox style."""
    import torch

    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def chain(head: Any, config: Any, embed: Any, tokens: Any, aux: Any, steps: int) -> list[Any]:
    """The head's logits [B, T-1, V] for draft steps 0..steps-1 of the chain starting at every
    position i (step s reads the token at i+s+1 and predicts the one at i+s+2), as vLLM's proposer
    computes them: step 0 from the target's hidden states, attending causally to step 0's keys;
    step s from step s-1's output (before the final norm), attending to step 0's keys up to i and
    to the chain's keys of steps 1..s."""
    import torch

    batch, width = tokens.shape
    anchors = width - 1
    nh = config.num_attention_heads
    hd = config.hidden_size // nh
    theta = float(config.rope_parameters["rope_theta"])
    layer = head.midlayer
    attn = layer.self_attn
    causal = torch.ones(anchors, anchors, dtype=torch.bool).tril()
    hidden = head.fc(aux[:, :anchors])
    k0 = v0 = None
    chain_k: list[Any] = []
    chain_v: list[Any] = []
    out = []
    for s in range(steps):
        index = (torch.arange(anchors) + s + 1).clamp(max=width - 1)
        emb = layer.input_layernorm(embed[tokens[:, index]])
        residual = hidden
        z = torch.cat([emb, layer.hidden_norm(hidden)], -1)

        def heads(t: Any) -> Any:
            return t.view(batch, anchors, nh, hd).transpose(1, 2)

        positions = torch.arange(anchors) + s
        q = rope(heads(attn.q_proj(z)), positions, theta)
        k = rope(heads(attn.k_proj(z)), positions, theta)
        v = heads(attn.v_proj(z))
        if k0 is None:
            k0, v0 = k, v
        else:
            chain_k.append(k)
            chain_v.append(v)
        scores = (q @ k0.transpose(-1, -2)) * hd**-0.5
        scores = scores.masked_fill(~causal, float("-inf"))
        if chain_k:
            ks, vs = torch.stack(chain_k, -2), torch.stack(chain_v, -2)  # [B, nh, A, s, hd]
            diagonal = (q.unsqueeze(-2) * ks).sum(-1) * hd**-0.5
            weights = torch.softmax(torch.cat([scores, diagonal], -1), -1)
            mixed = weights[..., :anchors] @ v0 + (weights[..., anchors:].unsqueeze(-1) * vs).sum(-2)
        else:
            mixed = torch.softmax(scores, -1) @ v0
        a = attn.o_proj(mixed.transpose(1, 2).reshape(batch, anchors, nh * hd))
        residual = a + residual
        h = layer.post_attention_layernorm(residual)
        m = layer.mlp.down_proj(torch.nn.functional.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
        hidden = m + residual
        out.append(head.lm_head(head.norm(hidden)))
    return out


def train_head(
    name: str, config: Any, target: Any, data: Sequence[tuple[list[int], Any, Any]], log: Any
) -> Any:
    """One head trained on `data` (token ids, auxiliary hidden states, greedy next tokens)."""
    import torch

    torch.manual_seed(SEED + 1)
    head = head_module(config, target)
    embed = target.model.embed_tokens.weight.detach()
    opt = torch.optim.AdamW(head.parameters(), lr=HEAD_LR, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(f"{SEED}/{name}")
    pad = config.pad_token_id
    for step in range(HEAD_STEPS):
        picked = [data[rng.randrange(len(data))] for _ in range(HEAD_BATCH)]
        width = max(len(ids) for ids, _, _ in picked)
        tokens = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _, _ in picked])
        aux = torch.zeros(len(picked), width, len(AUX_LAYERS) * config.hidden_size)
        best = torch.zeros(len(picked), width, dtype=torch.long)
        lengths = torch.tensor([len(ids) for ids, _, _ in picked])
        for i, (ids, a, b) in enumerate(picked):
            aux[i, : len(ids)], best[i, : len(ids)] = a, b
        for group in opt.param_groups:
            group["lr"] = schedule(step, HEAD_STEPS, HEAD_LR)
        logits = chain(head, config, embed, tokens, aux, CHAIN_STEPS)
        loss = torch.zeros(())
        anchors = torch.arange(width - 1)
        for s, step_logits in enumerate(logits):
            index = (anchors + s + 1).clamp(max=width - 1)
            valid = (anchors[None, :] + s + 1) < lengths[:, None]
            ce = torch.nn.functional.cross_entropy(
                step_logits.reshape(-1, step_logits.shape[-1]), best[:, index].reshape(-1), reduction="none"
            ).view(valid.shape)
            loss = loss + 0.8**s * (ce * valid).sum() / valid.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == HEAD_STEPS - 1:
            log(f"head {name} step {step}: loss {loss.item():.3f}")
    return head


def acceptance(head: Any, config: Any, target: Any, seq: list[int], prompt_len: int, k: int) -> list[int]:
    """Draft tokens accepted at each verify step of greedy decoding with `k` drafts, from the
    prompt's end to the sequence's (the sequence being the target's own greedy continuation)."""
    import torch

    tokens = torch.tensor([seq])
    aux, _ = target_view(target, [seq], config.pad_token_id)[0]
    with torch.no_grad():
        logits = chain(head, config, target.model.embed_tokens.weight, tokens, aux[None], k)
    drafts = [step[0].argmax(-1).tolist() for step in logits]
    accepted = []
    p = prompt_len  # the first answer token came from the prefill; drafting starts after it
    while p + k < len(seq):
        n = 0
        while n < k and drafts[n][p - 1] == seq[p + 1 + n]:
            n += 1
        accepted.append(n)
        p += n + 1
    return accepted


def head_config(target: Any) -> dict[str, Any]:
    """The head's config.json: the target's Llama config with one layer, the EAGLE-3 fields."""
    cfg: dict[str, Any] = target.config.to_dict()
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        num_hidden_layers=1,
        target_hidden_size=target.config.hidden_size,
        draft_vocab_size=target.config.vocab_size,
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS), "use_aux_hidden_state": True},
    )
    for key in ("_name_or_path", "transformers_version", "dtype"):
        cfg.pop(key, None)
    cfg["torch_dtype"] = "float32"
    return cfg


def save_head(head: Any, target: Any, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    tensors = {name: p.detach().contiguous() for name, p in head.named_parameters()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(head_config(target), indent=2, sort_keys=True) + "\n")


# -- the build --


def build(out: Path, log: Any) -> None:
    import torch
    from transformers import LlamaForCausalLM

    started = time.monotonic()
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    # deterministic mode would also fill every new tensor with NaN (slower than the training itself);
    # no result here reads memory it did not write
    torch.utils.deterministic.fill_uninitialized_memory = False
    report: dict[str, Any] = {"seed": SEED, "digest": digest(), "checks": CHECKS}
    lines = [
        render(d.prompt, d.answer)
        for domain in domains.DOMAINS
        for d in domains.documents(domain, "target", TARGET_DOCS, SEED)
    ]
    tokenizer = tiny_model.train_tokenizer(lines, VOCAB_SIZE)
    model = train_target(tokenizer, log)
    model.save_pretrained(out / "target", safe_serialization=True)
    tokenizer.save_pretrained(out / "target")
    report["seconds_target"] = round(time.monotonic() - started, 1)
    # everything below reads the target as vLLM will: from its saved files
    target = LlamaForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()

    checked = {}
    distinct: dict[str, Any] = {}
    for domain in domains.DOMAINS:
        prompts = domains.prompts(domain, "check", CHECK_PROMPTS, SEED)
        checked[domain] = greedy(target, tokenizer, prompts, CHECK_TOKENS)
        answers = [seq[n:] for seq, n in checked[domain]]
        distinct[domain] = {
            "all": len({t for a in answers for t in a}),
            "min_per_continuation": min(len(set(a)) for a in answers),
            "example": tokenizer.decode(answers[0]),
        }
        log(f"target on {domain}: {distinct[domain]}")
    report["distinct_tokens"] = distinct

    t0 = time.monotonic()
    data: dict[str, list[tuple[list[int], Any, Any]]] = {}
    for domain in domains.DOMAINS:
        prompts = domains.prompts(domain, "head", HEAD_PROMPTS, SEED)
        seqs = [seq for seq, _ in greedy(target, tokenizer, prompts, GENERATE_TOKENS)]
        views = target_view(target, seqs, tokenizer.pad_token_id)
        data[domain] = [(s, a, b) for s, (a, b) in zip(seqs, views, strict=True)]
    report["seconds_head_data"] = round(time.monotonic() - t0, 1)

    accept: dict[str, dict[str, float]] = {}
    for name, trained_on in HEADS.items():
        t0 = time.monotonic()
        share = HEAD_PROMPTS // len(trained_on)
        head = train_head(name, target.config, target, [x for d in trained_on for x in data[d][:share]], log)
        save_head(head, target, out / f"eagle3-{name}")
        accept[name] = {}
        for domain in domains.DOMAINS:
            steps = [
                n
                for seq, n0 in checked[domain]
                for n in acceptance(head, target.config, target, seq, n0, CHECK_K)
            ]
            accept[name][domain] = round(1 + sum(steps) / len(steps), 3)
        report[f"seconds_head_{name}"] = round(time.monotonic() - t0, 1)
        log(f"head {name}: offline accept length at k={CHECK_K} {accept[name]}")
    report["accept_length_offline"] = accept
    report["seconds"] = round(time.monotonic() - started, 1)
    # what two builds must agree on, byte for byte
    report["sha256"] = {
        str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(out.rglob("*.safetensors"))
    }
    failed = failures(distinct, accept)
    report["failed"] = failed
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if failed:
        print(json.dumps(report, indent=2), file=sys.stderr)
        raise SystemExit("eagle3_pair: the build fails its checks: " + "; ".join(failed))


def failures(distinct: dict[str, Any], accept: dict[str, dict[str, float]]) -> list[str]:
    c = CHECKS
    out = []
    for domain, d in distinct.items():
        if d["all"] < c["min_distinct_tokens_per_domain"]:
            out.append(f"the target's {domain} continuations use {d['all']} distinct tokens")
        if d["min_per_continuation"] < c["min_distinct_tokens_per_continuation"]:
            out.append(f"a {domain} continuation uses {d['min_per_continuation']} distinct tokens")
    if accept["code"]["code"] < c["code_head_min_accept_code"]:
        out.append(f"the code head's accept length on code is {accept['code']['code']}")
    if accept["code"]["prose"] > c["code_head_max_accept_prose"]:
        out.append(f"the code head's accept length on prose is {accept['code']['prose']}")
    if min(accept["mixed"].values()) < c["mixed_head_min_accept"]:
        out.append(f"the mixed head's accept lengths are {accept['mixed']}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=default_cache(), help="where builds are kept")
    parser.add_argument("--rebuild", action="store_true", help="build again even when cached")
    args = parser.parse_args(argv)
    if args.rebuild:
        shutil.rmtree(args.cache / f"eagle3-pair-{digest()}", ignore_errors=True)
    started = time.monotonic()
    out = ensure(args.cache)
    report = json.loads((out / "report.json").read_text())
    print(f"accept length offline (k={CHECK_K}): {report['accept_length_offline']}; "
          f"ready in {time.monotonic() - started:.0f} s")  # fmt: skip
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
