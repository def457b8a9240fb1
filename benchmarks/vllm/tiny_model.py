"""Build a tiny random-weight Llama and its tokenizer locally, for running a real vLLM on a CPU.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with `tokenizers` on a seeded
synthetic corpus plus the prompt sets shipped in `controller/bench/prompt_sets/`, and the model is
`transformers`' `LlamaForCausalLM` (hidden 256, 4 layers, vocab 4096) initialised from a fixed
seed, so the same command builds the same files on any machine. The end-of-sequence row of the
output layer is zeroed: its logit is then exactly 0 while some other token's is positive at every
step, so greedy decoding never stops early and a benchmark gets the `max_tokens` it asked for.

Run it in the environment that has vLLM (it needs torch, transformers and tokenizers, which are
not specroute's dependencies):

    python benchmarks/vllm/tiny_model.py /tmp/tiny-llama

The files it writes (a few MB) are build output: never commit them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROMPT_SETS = ROOT / "controller" / "bench" / "prompt_sets"

VOCAB_SIZE = 4096
HIDDEN = 256
LAYERS = 4
HEADS = 4
INTERMEDIATE = 688
MAX_POSITIONS = 2048
SEED = 0
SPECIALS = ("<|begin|>", "<|end|>", "<|pad|>")
# A plain chat template: each message on its own line after its role, then the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def corpus(seed: int = SEED, words: int = 120_000) -> list[str]:
    """Lines of training text: the shipped prompt sets, then seeded pseudo-words in sentences."""
    lines: list[str] = []
    for path in sorted(PROMPT_SETS.glob("*.jsonl")):
        for raw in path.read_text(encoding="utf-8").splitlines():
            if raw.strip():
                for message in json.loads(raw).get("messages", []):
                    lines.append(str(message.get("content", "")))
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w"]
    onsets += ["st", "tr", "ch"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ck"]
    lexicon = [
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 4)))
        for _ in range(6000)
    ]
    sentence: list[str] = []
    for _ in range(words):
        # Zipf-like: a few words are frequent, most are rare, as in real text.
        sentence.append(lexicon[min(int(rng.paretovariate(1.1)) - 1, len(lexicon) - 1)])
        if len(sentence) >= rng.randint(6, 18):
            lines.append(" ".join(sentence).capitalize() + rng.choice([".", ".", "?", "!", ";"]))
            sentence = []
    return lines


def train_tokenizer(lines: list[str], vocab_size: int = VOCAB_SIZE) -> Any:
    """A byte-level BPE trained on `lines`, with the specials and the chat template (a
    `transformers.PreTrainedTokenizerFast`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(lines, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=SPECIALS[0], eos_token=SPECIALS[1], pad_token=SPECIALS[2]
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = MAX_POSITIONS
    return tokenizer


def llama_config(tokenizer: Any, **overrides: Any) -> Any:
    """The tiny Llama's `transformers.LlamaConfig` for `tokenizer` (hidden 256, 4 layers unless
    `overrides` say otherwise)."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    return LlamaConfig(**{**fields, **overrides})


def never_ends(model: Any, tokenizer: Any) -> None:
    """Zero the end-of-sequence row of the output layer: its logit is then exactly 0 while some
    other token's is positive, so greedy decoding gives the `max_tokens` asked for."""
    import torch

    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()


def build(out: Path, seed: int = SEED) -> None:
    import torch
    from transformers import LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus(seed))
    tokenizer.save_pretrained(out)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(tokenizer))
    never_ends(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    print(f"tiny llama: vocab {len(tokenizer)}, hidden {HIDDEN}, {LAYERS} layers, seed {seed} -> {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the model and tokenizer into")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    build(args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
