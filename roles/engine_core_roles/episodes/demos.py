"""Demonstration episodes for a supervised warm-up: each conversation tokenized as the episode
rollout samples it, trained on the assistant's tokens only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.errors import ConfigError
from engine_core_roles.episodes.protocol import Message
from engine_core_roles.episodes.template import _Template, check_messages

__all__ = ["demo_batch"]


def demo_batch(
    tokenizer: Any, tools: list[dict[str, Any]] | None, episodes: Sequence[Sequence[Message]]
) -> TensorDict:
    """A supervised batch of demonstration episodes, tokenized the way :class:`EpisodeRollout`
    tokenizes episodes (the first messages rendered with the generation prompt, then each
    assistant turn's content and end of turn, then the template's rendering of what follows):
    ``input_ids``, ``attention_mask``, ``position_ids`` and ``loss_mask`` (1 on the
    assistant's tokens only)."""
    from engine_core import make_batch

    template = _Template(tokenizer, tools)
    eos = template.end_of_turn()
    rows: list[tuple[list[int], list[int]]] = []
    for i, messages in enumerate(episodes):
        msgs = [dict(m) for m in messages]
        check_messages(msgs, f"demonstration {i}")
        first = next((j for j, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if first is None:
            raise ConfigError(f"demonstration {i} has no assistant message to learn from.")
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
        rows.append((ids, trained))
    width = max(len(ids) for ids, _ in rows)
    pad = int(tokenizer.pad_token_id or 0)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    loss = torch.zeros_like(input_ids)
    for i, (ids, trained) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attn[i, : len(ids)] = 1
        loss[i, : len(ids)] = torch.tensor(trained)
    return make_batch(input_ids, attn, loss_mask=loss)


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
