"""The embedded default text task: a tiny tokenizer, prompt files and a reward, shipped with the
recipes so ``engine-core run`` needs nothing downloaded.

The task: the user message is three digits, the answer is them reversed
(``<|im_start|>user\\n123<|im_end|>\\n<|im_start|>assistant\\n`` → ``321<|im_end|>``). The
tokenizer is transformers' Qwen2 tokenizer (byte-level BPE, no merges) over a small alphabet
(digits, lowercase letters, punctuation; anything else is dropped), plus the ChatML markers
and the role names as whole tokens, with a ChatML chat template. :func:`digits_reward` scores a response by the positions it gets right.

``python -m engine_core_roles.data.tasks.tiny_text FOLDER`` writes the tokenizer and the data files again;
``tests/test_tiny_text.py`` checks that the shipped ones are exactly what it writes.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "build_tokenizer",
    "chats",
    "digits_reward",
    "reverse_rows",
    "write_files",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROLE_WORDS = ("system", "user", "assistant", "tool")
SYSTEM = "reverse the digits."
"""The system message of the shipped conversations (``chats_train.jsonl``, ``chats_val.jsonl``)."""
ALPHABET = "0123456789 \n+-*/=<>()[]{}.,:;?!'\"_abcdefghijklmnopqrstuvwxyz"
"""The shipped tokenizer's characters: enough for small arithmetic and word tasks, few enough
that a randomly initialised model finds the digits by sampling (any other character is dropped:
bring a real tokenizer for real text)."""


def _byte_symbols() -> list[str]:
    """The printable stand-ins byte-level BPE uses for the bytes 0..255, in byte order."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def build_tokenizer(
    folder: str | Path | None = None,
    *,
    alphabet: str | None = ALPHABET,
    words: Sequence[str] = ROLE_WORDS,
) -> Any:
    """A Qwen2 tokenizer (byte-level BPE, no merges): one token per character of ``alphabet``
    (None: per byte, all 256; a character outside the alphabet is dropped, as transformers'
    Qwen2 tokenizer has no unknown token), then ``<|im_end|>`` (EOS),
    ``<|endoftext|>`` (padding), ``<|im_start|>`` and ``words`` as whole tokens; saved to
    ``folder`` when given."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    symbols = _byte_symbols()
    if alphabet is None:
        vocab = {sym: i for i, sym in enumerate(symbols)}
    else:
        vocab = {symbols[ord(c)]: i for i, c in enumerate(dict.fromkeys(alphabet))}
        vocab["<unk>"] = len(vocab)  # reserved: transformers' Qwen2 tokenizer maps nothing to it
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,  # type: ignore[arg-type]
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.add_tokens(["<|im_end|>", "<|endoftext|>"], special_tokens=True)
    if words:
        tok.add_tokens(list(words))
    tok.chat_template = CHAT_TEMPLATE
    if folder is not None:
        tok.save_pretrained(str(folder))
    return tok


def reverse_rows(num_digits: int = 3) -> list[dict[str, Any]]:
    """Every prompt of the task: ``num_digits`` digits as a user message, the answer reversed."""
    rows = []
    for n in range(10**num_digits):
        digits = str(n).zfill(num_digits)
        rows.append({"prompt": [{"role": "user", "content": digits}], "answer": digits[::-1]})
    return rows


def chats(rows: Sequence[dict[str, Any]], system: str = SYSTEM) -> list[dict[str, Any]]:
    """Conversations of one to three turns (in turn) made of consecutive ``rows`` (a user's
    digits, the assistant's answer), every other one opening with the ``system`` message."""
    out: list[dict[str, Any]] = []
    start = 0
    while start < len(rows):
        turns = rows[start : start + 1 + len(out) % 3]
        start += len(turns)
        messages = [{"role": "system", "content": system}] if len(out) % 2 == 0 else []
        for r in turns:
            messages += [*r["prompt"], {"role": "assistant", "content": r["answer"]}]
        out.append({"messages": messages})
    return out


def write_files(
    folder: str | Path, *, val_size: int = 100, demos: int = 64, val_chats: int = 16, seed: int = 0
) -> None:
    """The tokenizer (``folder/tokenizer``), the prompts split into ``train.jsonl`` and a
    held-out ``val.jsonl`` of ``val_size`` rows, ``demos.jsonl``: the first ``demos``
    training prompts answered, as conversations for the job's supervised warm-up, and the same
    answers as multi-turn conversations for supervised training (``chats_train.jsonl``; the
    first ``val_chats`` held-out prompts in ``chats_val.jsonl``)."""
    folder = Path(folder)
    build_tokenizer(folder / "tokenizer")
    rows = reverse_rows()
    random.Random(seed).shuffle(rows)
    train = rows[val_size:]
    answered = [
        {"messages": [*r["prompt"], {"role": "assistant", "content": r["answer"]}]}
        for r in train[:demos]
    ]
    for name, part in (
        ("val.jsonl", rows[:val_size]),
        ("train.jsonl", train),
        ("demos.jsonl", answered),
        ("chats_train.jsonl", chats(train[:demos])),
        ("chats_val.jsonl", chats(rows[:val_chats])),
    ):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in part))


def digits_reward(prompt: str, response: str, answer: str, **_: Any) -> float:
    """The share of the answer's positions the response gets right; extra characters count
    as wrong ones (``321`` → 1.0, ``32`` → 2/3, ``3210`` → 3/4)."""
    del prompt
    right = sum(r == a for r, a in zip(response, answer, strict=False))
    return right / max(len(answer), len(response), 1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m engine_core_roles.data.tasks.tiny_text FOLDER")
    write_files(sys.argv[1])
