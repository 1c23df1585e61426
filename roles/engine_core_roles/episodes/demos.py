"""Demonstrations for supervised training (the RL job's warm-up, the SFT job): each conversation
tokenized as the episode rollout samples it, trained on the assistant's tokens only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from engine_core.errors import ConfigError
from engine_core.vision import vision_fields
from engine_core_roles.batch.build import sequence_batch
from engine_core_roles.data.datasets.images import (
    EncodedTexts,
    ImagePromptRenderer,
    image_parts,
)
from engine_core_roles.episodes.protocol import Message
from engine_core_roles.episodes.template import _Template, check_messages

__all__ = ["DemoRenderer", "demo_batch"]


class DemoRenderer:
    """Conversations tokenized the way :class:`EpisodeRollout` tokenizes episodes: the messages
    before the first assistant turn rendered with the generation prompt, then each assistant
    turn's content and end of turn (what the model writes, and trains on), then the template's
    rendering of the messages that follow it, up to the next assistant turn's start.

    Calling it on one conversation returns its token ids and loss mask (1 on the assistant's
    tokens only). With ``images`` (a vision-language model's renderer of images), messages may
    hold image parts: each placeholder the template renders is expanded to its image's tokens,
    which are never trained on (an image in an assistant message is refused: the model writes
    text), and :attr:`images` reads the pixels a batch of such rows carries.
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict[str, Any]] | None = None,
        *,
        images: ImagePromptRenderer | None = None,
    ) -> None:
        self.tokenizer, self.tools, self.images = tokenizer, tools, images
        self.template = _Template(tokenizer, tools)
        self.end_of_turn = self.template.end_of_turn()

    def fingerprint(self) -> str:
        """What the rendering depends on (the tokenizer, its template, the tools, the image
        processor), as text: a dataset's cached rendering is reused only under the same one."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)  # a fast tokenizer's whole definition
        defined = hashlib.sha256(backend.to_str().encode()).hexdigest() if backend else None
        parts = ["demo-rendering-1", len(tok), tok.name_or_path, defined, tok.chat_template]
        processor = None if self.images is None else self.images.processor.to_json_string()
        return json.dumps([*parts, self.tools, processor], default=str)

    def __call__(
        self, messages: Sequence[Message], who: str = "a demonstration", *, base: Path | None = None
    ) -> tuple[list[int], list[int]]:
        """``messages``' token ids and loss mask; ``base``: the folder image paths are relative
        to (the data file's)."""
        ids, trained, _ = self.encode(messages, who, base=base)
        return ids, trained

    def encode(
        self, messages: Sequence[Message], who: str = "a demonstration", *, base: Path | None = None
    ) -> tuple[list[int], list[int], EncodedTexts | None]:
        """As calling it, and the encoding with the images' pixel patches and grids (None for
        a text model's renderer)."""
        msgs = [dict(m) for m in messages]
        check_messages(msgs, who)
        pieces = self._pieces(msgs, who)
        texts = [text for text, _ in pieces]
        parts = image_parts(msgs)
        if parts and self.images is None:
            raise ConfigError(
                f"{who} holds {len(parts)} image(s) and the model is a text model; train a "
                f"vision-language model (engine.model.path: a folder with its image "
                f"processor), or drop the images."
            )
        out = None
        if self.images is None:
            encoded = [self.template.ids(text) for text in texts]
        else:
            out = self.images.encode(texts, parts, base=base or Path.cwd(), where=who)
            encoded = out.ids
        ids: list[int] = []
        trained: list[int] = []
        for (_, train), piece in zip(pieces, encoded, strict=True):
            ids += piece
            trained += [int(train)] * len(piece)
        return ids, trained, out

    def _pieces(self, msgs: list[dict[str, Any]], who: str) -> list[tuple[str, bool]]:
        """The conversation as text, in pieces each trained on or not."""
        template, eos = self.template, self.end_of_turn
        first = next((j for j, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if first is None:
            raise ConfigError(f"{who} has no assistant message to learn from.")
        pieces = [(template.render(msgs[:first], generation=True), False)]
        j = first
        while j < len(msgs):
            content = _assistant_text(msgs[j], who)
            pieces.append((content + eos, True))
            k = j + 1
            while k < len(msgs) and msgs[k]["role"] != "assistant":
                k += 1
            if k > j + 1:
                pieces.append((template.after_turn_text(content + eos, msgs[j + 1 : k]), False))
            j = k
        return pieces


def demo_batch(
    tokenizer: Any,
    tools: list[dict[str, Any]] | None,
    episodes: Sequence[Sequence[Message]],
    *,
    images: ImagePromptRenderer | None = None,
    bases: Sequence[Path] | None = None,
    episode_tools: Sequence[list[dict[str, Any]] | None] | None = None,
) -> TensorDict:
    """A supervised batch of demonstration episodes, each tokenized by :class:`DemoRenderer`:
    ``input_ids``, ``attention_mask``, ``position_ids`` and ``loss_mask`` (1 on the
    assistant's tokens only); with ``images`` (a vision-language model's renderer), the
    episodes' images too (``pixel_values``, ``image_grid_thw``), their paths relative to each
    episode's folder in ``bases``. ``episode_tools[i]``, where given and not None, are the tools
    episode ``i`` was played with (its demonstration file's ``tools``), rendered in place of
    ``tools``."""
    renderers: dict[str, DemoRenderer] = {}

    def renderer(i: int) -> DemoRenderer:
        own = None if episode_tools is None else episode_tools[i]
        chosen = tools if own is None else own
        key = json.dumps(chosen, sort_keys=True)
        if key not in renderers:
            renderers[key] = DemoRenderer(tokenizer, chosen, images=images)
        return renderers[key]

    where = [Path.cwd()] * len(episodes) if bases is None else list(bases)
    rows, pixels, grids = [], [], []
    for i, (messages, base) in enumerate(zip(episodes, where, strict=True)):
        render = renderer(i)
        ids, trained, encoded = render.encode(messages, f"demonstration {i}", base=base)
        rows.append((ids, trained))
        pixels.append(None if encoded is None else encoded.pixel_values)
        grids.append(None if encoded is None else encoded.grids)
    batch = sequence_batch(rows, pad_token_id=int(tokenizer.pad_token_id or 0))
    if any(g is not None for g in grids):
        batch.update(vision_fields(pixels, grids))
    return batch


def _assistant_text(message: Message, who: str) -> str:
    """An assistant message as the model writes it: its content (a list of text parts joined),
    then each of its ``tool_calls`` in the Hermes format."""
    content = message.get("content") or ""
    if isinstance(content, list):
        if image_parts([message]):
            raise ConfigError(
                f"{who}: an assistant message holds an image; a model writes text only, so "
                f"its turns cannot be trained on images. Move the image to a user message."
            )
        content = "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    text = str(content)
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        text += "<tool_call>" + json.dumps({"name": fn["name"], "arguments": args}) + "</tool_call>"
    return text
