"""The shipped tool task: an answer only a tool knows, for ``recipes/agent_tiny.yaml``.

The user message is a key of two letters (``"qe"``); the answer is the three digits a hidden
table holds for it, which nothing in the prompt gives away. The model has one tool,
:func:`lookup`: an episode that calls it (``<tool_call>{"name": "lookup", "arguments":
{"key": "qe"}}</tool_call>``) reads the digits in the ``tool`` message and answers them.
:func:`answer_reward` scores the final answer by the positions it gets right.

The tokenizer is the text task's (:func:`engine_core_roles.data.tasks.tiny_text.build_tokenizer`) with the
tool markers and the words of a call as whole tokens, and a ChatML template that renders
``tools`` (their names, in a system message), assistant ``tool_calls`` and ``tool`` messages
the way Qwen2's does. ``demos.jsonl`` holds a few demonstration episodes for the supervised
warm-up (``warmup_sft_steps``), each with the tools it was played with (``tools``).

``python -m engine_core_roles.data.tasks.tiny_agent FOLDER`` writes the tokenizer and the data files
again; ``tests/test_agents.py`` checks that the shipped ones are exactly what it writes.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
import sys
from pathlib import Path
from typing import Any

from engine_core_roles.data.tasks.tiny_text import ROLE_WORDS, build_tokenizer

__all__ = ["CHAT_TEMPLATE", "LOOKUP_SCHEMA", "answer_reward", "lookup", "value_of", "write_files"]

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>tool\n<tool_response>{{ m['content'] }}"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_WORDS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "lookup",
    "name",
    "arguments",
    "key",
)


def value_of(key: str) -> str:
    """The hidden table: three digits for each key (a hash; nothing about the key tells)."""
    return str(int(hashlib.sha256(key.encode()).hexdigest(), 16) % 1000).zfill(3)


def lookup(key: str) -> str:
    """Look up the value stored under a key.

    Args:
        key: two lowercase letters
    """
    if len(key) != 2 or not all(c in string.ascii_lowercase for c in key):
        raise KeyError(f"no key {key!r}; keys are two lowercase letters")
    return value_of(key)


#: :func:`lookup`'s OpenAI function schema, as the tool environment derives it from the
#: docstring; each demonstration names it (``tools``), so an agent job warms up on prompts that
#: show the tool its agent sends
LOOKUP_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up the value stored under a key.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "two lowercase letters"}},
            "required": ["key"],
        },
    },
}


def answer_reward(prompt: str, response: str, answer: str, **_: Any) -> float:
    """The share of the answer's three digits the final message gets right, in place."""
    del prompt
    right = sum(r == a for r, a in zip(response.strip(), answer, strict=False))
    return right / max(len(answer), len(response.strip()), 1)


def _rows() -> list[dict[str, Any]]:
    keys = [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    return [
        {"prompt": [{"role": "user", "content": k}], "key": k, "answer": value_of(k)} for k in keys
    ]


def demonstration(key: str) -> list[dict[str, Any]]:
    """The episode a good policy plays for ``key``: one call, then the value."""
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}
    return [
        {"role": "user", "content": key},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "lookup", "content": value_of(key)},
        {"role": "assistant", "content": value_of(key)},
    ]


def write_files(
    folder: str | Path, *, val_size: int = 100, demos: int = 128, seed: int = 0
) -> None:
    """The tokenizer (``folder/tokenizer``), ``train.jsonl``, a held-out ``val.jsonl`` of
    ``val_size`` keys and ``demos.jsonl``: demonstration episodes on ``demos`` train keys."""
    folder = Path(folder)
    tok = build_tokenizer(words=(*ROLE_WORDS, *TOOL_WORDS))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder / "tokenizer"))
    rows = _rows()
    random.Random(seed).shuffle(rows)
    val, train = rows[:val_size], rows[val_size:]
    for name, part in (("val.jsonl", val), ("train.jsonl", train)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    shown = [{"messages": demonstration(r["key"]), "tools": [LOOKUP_SCHEMA]} for r in train[:demos]]
    (folder / "demos.jsonl").write_text("".join(json.dumps(d) + "\n" for d in shown))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m engine_core_roles.data.tasks.tiny_agent FOLDER")
    write_files(sys.argv[1])
