"""Demonstrations for supervised training (the RL job's warm-up, the SFT job): each conversation
tokenized as the episode rollout samples it, trained on the assistant's tokens only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict

from engine_core.errors import ConfigError
from engine_core_roles.batch.build import sequence_batch
from engine_core_roles.episodes.protocol import Message
from engine_core_roles.episodes.template import _Template, check_messages

__all__ = ["DemoRenderer", "demo_batch"]


class DemoRenderer:
    """Conversations tokenized the way :class:`EpisodeRollout` tokenizes episodes: the messages
    before the first assistant turn rendered with the generation prompt, then each assistant
    turn's content and end of turn (what the model writes, and trains on), then the template's
    rendering of the messages that follow it, up to the next assistant turn's start.

    Calling it on one conversation returns its token ids and loss mask (1 on the assistant's
    tokens only).
    """

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        self.template = _Template(tokenizer, tools)
        self.end_of_turn = self.template.end_of_turn()

    def fingerprint(self) -> str:
        """What the rendering depends on (the tokenizer, its template, the tools), as text: a
        dataset's cached rendering is reused only under the same one."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)  # a fast tokenizer's whole definition
        defined = hashlib.sha256(backend.to_str().encode()).hexdigest() if backend else None
        parts = ["demo-rendering-1", len(tok), tok.name_or_path, defined, tok.chat_template]
        return json.dumps([*parts, self.tools], default=str)

    def __call__(
        self, messages: Sequence[Message], who: str = "a demonstration"
    ) -> tuple[list[int], list[int]]:
        template, eos = self.template, self.end_of_turn
        msgs = [dict(m) for m in messages]
        check_messages(msgs, who)
        first = next((j for j, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if first is None:
            raise ConfigError(f"{who} has no assistant message to learn from.")
        ids = template.prompt(msgs[:first])
        trained = [0] * len(ids)
        j = first
        while j < len(msgs):
            content = _assistant_text(msgs[j])
            turn = template.ids(content + eos)
            ids += turn
            trained += [1] * len(turn)
            k = j + 1
            while k < len(msgs) and msgs[k]["role"] != "assistant":
                k += 1
            if k > j + 1:
                obs = template.after_turn(content + eos, msgs[j + 1 : k])
                ids += obs
                trained += [0] * len(obs)
            j = k
        return ids, trained


def demo_batch(
    tokenizer: Any, tools: list[dict[str, Any]] | None, episodes: Sequence[Sequence[Message]]
) -> TensorDict:
    """A supervised batch of demonstration episodes, each tokenized by :class:`DemoRenderer`:
    ``input_ids``, ``attention_mask``, ``position_ids`` and ``loss_mask`` (1 on the
    assistant's tokens only)."""
    render = DemoRenderer(tokenizer, tools)
    rows = [render(messages, f"demonstration {i}") for i, messages in enumerate(episodes)]
    return sequence_batch(rows, pad_token_id=int(tokenizer.pad_token_id or 0))


def _assistant_text(message: Message) -> str:
    """An assistant message as the model writes it: its content, then each of its
    ``tool_calls`` in the Hermes format."""
    text = str(message.get("content") or "")
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        text += "<tool_call>" + json.dumps({"name": fn["name"], "arguments": args}) + "</tool_call>"
    return text
