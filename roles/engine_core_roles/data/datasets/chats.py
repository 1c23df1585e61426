"""Chat datasets for supervised training: :class:`ChatData` reads conversations (a column of
``{"role", "content"}`` messages) from JSONL, Parquet or saved ``datasets`` folders, checks every
row before anything trains, tokenizes each conversation once through the renderer a job hands it
(token ids and a loss mask), drops conversations too long for the model (counted), and hands out
batches in a seeded order, epoch after epoch; its position is a small dict the job's checkpoint
keeps. Conversations whose messages hold images (for a vision-language model's renderer) carry
their images' pixel patches and grids in their batch, read for each batch, not kept.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import Field, PositiveInt
from tensordict import TensorDict

from engine_core.errors import ConfigError
from engine_core.vision import vision_fields
from engine_core_roles.batch.build import sequence_batch
from engine_core_roles.data.datasets.files import FilesConfig, SeededOrder, concatenate, read_parts
from engine_core_roles.data.datasets.images import ImagePromptRenderer, image_parts

__all__ = ["ChatDataConfig", "ChatData", "ChatRenderer", "check_conversation"]

_IDS, _MASK, _LENGTH = "_engine_core_ids", "_engine_core_loss_mask", "_engine_core_length"
_IMAGES = "_engine_core_images"  # how many images a conversation holds


class ChatDataConfig(FilesConfig):
    """Where the conversations come from (one a row) and how they are drawn."""

    messages_key: str = Field(
        "messages",
        description="The column of conversations: a list of {role, content} messages with at "
        "least one assistant message; the assistant's tokens are trained on.",
    )
    max_length: PositiveInt | None = Field(
        None,
        description="Longer conversations (in tokens) are dropped (counted); default: the "
        "model's context.",
    )


class ChatRenderer(Protocol):
    """Tokenizes one conversation: its token ids and a loss mask of as many entries (1 on the
    tokens trained on). ``who`` names the conversation in errors, ``base`` is the folder its
    image paths are relative to; :meth:`fingerprint` changes whenever the output would (the
    tokenizer, its template), so a cached rendering is reused only for the same one.
    ``images`` reads a conversation's images for its batch (None: a text model's renderer,
    which refuses conversations with images)."""

    images: ImagePromptRenderer | None

    def __call__(
        self, messages: Sequence[dict[str, Any]], who: str, *, base: Path | None = None
    ) -> tuple[list[int], list[int]]: ...

    def fingerprint(self) -> str: ...


def check_conversation(messages: Any, who: str) -> None:
    """Refuse a conversation that is not a list of ``{role, content}`` messages, or that has no
    assistant message to learn from."""
    if not isinstance(messages, list) or not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m
        for m in messages
    ):
        raise ConfigError(
            f"{who} is {str(messages)[:80]!r}; a conversation is a list of messages, each a "
            f"dict with 'role' and 'content'. Fix the row, or drop it."
        )
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(m["role"] for m in messages) or "no messages"
        raise ConfigError(
            f"{who} has no assistant message to learn from (its roles: {roles}); every "
            f"conversation needs at least one assistant turn. Add the answer, or drop the row."
        )


class ChatData:
    """Tokenized, length-filtered conversations of one dataset, drawn in a seeded order.

    Each row is rendered once by ``render`` (cached by ``datasets`` under the renderer's
    fingerprint); :meth:`batch` pads rows into a supervised batch (``input_ids``,
    ``attention_mask``, ``position_ids``, ``loss_mask``). :meth:`state_dict` /
    :meth:`load_state_dict` are the draw position (epoch, index).
    """

    def __init__(
        self,
        files: Sequence[str],
        render: ChatRenderer,
        cfg: ChatDataConfig,
        *,
        max_length: int,
        pad_token_id: int,
        what: str = "data.train_files",
    ) -> None:
        self.cfg, self.render, self.what, self.pad_token_id = cfg, render, what, pad_token_id
        parts = read_parts(files, what, rows="conversations")
        data = concatenate(parts, files, what, rows="conversations")
        key = cfg.messages_key
        if key not in data.column_names:
            raise ConfigError(
                f"{what}: no {key!r} column; the columns are {', '.join(data.column_names)}. "
                f"Set data.messages_key to the column of conversations (lists of "
                f"{{'role', 'content'}} messages)."
            )
        self._origins = [(name, len(part)) for name, part in parts]
        fingerprint = hashlib.sha256(
            json.dumps([data._fingerprint, key, render.fingerprint()]).encode()
        ).hexdigest()[:16]
        self.max_length = max_length
        rendered = data.select_columns([key]).map(
            self._render_batch,
            batched=True,
            with_indices=True,
            # a conversation's ids depend on its images' sizes, which the fingerprint does not see
            load_from_cache_file=render.images is None,
            new_fingerprint=fingerprint,
            desc="tokenizing conversations",
        )
        keep = [i for i, n in enumerate(rendered[_LENGTH]) if n <= max_length]
        self.total, self.dropped = len(rendered), len(rendered) - len(keep)
        self._rows = keep  # the row (of the files together) of each kept conversation
        if not keep:
            raise ConfigError(
                f"{what}: all {self.total} conversations are longer than {max_length} tokens "
                f"(the model's context, or data.max_length); shorten them, or use a model with "
                f"a longer context."
            )
        self.data = rendered if not self.dropped else rendered.select(keep)
        # views, selected once: a batch reads its rows' tokens, and its pictured rows' messages
        self._tokens = self.data.select_columns([_IDS, _MASK, _IMAGES])
        self._messages = self.data.select_columns([key])
        self.order = SeededOrder(
            len(self.data), shuffle=cfg.shuffle, seed=cfg.seed, what=what, rows="conversations"
        )

    def __len__(self) -> int:
        return len(self.data)

    def where(self, index: int) -> str:
        """Row ``index`` of the dataset as the user knows it: ``row N of FILE`` (from 1)."""
        first, name = self._first(index)
        return f"row {index + 1 - first} of {name}"

    def _first(self, index: int) -> tuple[int, str]:
        """The file that row ``index`` (of the files together) is in: its first row, its name."""
        first = 0
        for name, size in self._origins:
            if index < first + size:
                return first, name
            first += size
        raise IndexError(index)

    def _origin(self, index: int) -> tuple[str, Path]:
        """Row ``index`` as errors name it, and the folder its image paths are relative to
        (its file's)."""
        return f"{self.what}: {self.where(index)}", Path(self._first(index)[1]).parent

    def _render_batch(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, Any]:
        ids, masks, images = [], [], []
        for messages, i in zip(batch[self.cfg.messages_key], indices, strict=True):
            who, base = self._origin(i)
            check_conversation(messages, who)
            present = [_present(m) for m in messages]
            row_ids, mask = self.render(present, who, base=base)
            count = len(image_parts(present))
            if count and len(row_ids) > self.max_length:
                raise ConfigError(
                    f"{who} is {len(row_ids)} tokens ({count} image(s) among them), over the "
                    f"{self.max_length} the model takes (its context, or data.max_length); a "
                    f"conversation with images is not dropped or cut (it would be cut through "
                    f"its image tokens). Use smaller images (or a smaller max_pixels in the "
                    f"image processor's config), raise data.max_length, or drop the row."
                )
            ids.append(row_ids)
            masks.append(mask)
            images.append(count)
        return {_IDS: ids, _MASK: masks, _LENGTH: [len(x) for x in ids], _IMAGES: images}

    def batch(self, indices: Sequence[int]) -> TensorDict:
        """The supervised batch of these rows (of the kept conversations), right-padded; with
        the rows' images (``pixel_values``, ``image_grid_thw``) where any has one."""
        rows = self._tokens[list(indices)]
        out = sequence_batch(
            list(zip(rows[_IDS], rows[_MASK], strict=True)), pad_token_id=self.pad_token_id
        )
        if any(rows[_IMAGES]):
            for key, value in self._images_of(indices, rows[_IMAGES]).items():
                out[key] = value
        return out

    def _images_of(self, indices: Sequence[int], counts: list[int]) -> dict[str, Any]:
        """The vision fields of these rows: read and processed for each batch, as a data
        loader does, not kept (a dataset's pixels would otherwise fill memory over an epoch)."""
        images = self.render.images
        assert images is not None  # rows with images were rendered by a renderer with one
        pixels: list[Any] = []
        grids: list[Any] = []
        key = self.cfg.messages_key
        for i, count in zip(indices, counts, strict=True):
            if not count:
                pixels.append(None)
                grids.append(None)
                continue
            who, base = self._origin(self._rows[i])
            messages = [_present(m) for m in self._messages[i][key]]
            values, grid = images.read(image_parts(messages), base, who)
            pixels.append(values)
            grids.append(grid)
        return vision_fields(pixels, grids)

    def next_indices(self, n: int) -> list[int]:
        """The next ``n`` rows in draw order (into the next epoch when this one runs out)."""
        return self.order.next_indices(n)

    def next_batch(self, n: int) -> TensorDict:
        return self.batch(self.next_indices(n))

    def batches(self, n: int) -> Iterator[TensorDict]:
        """Every row once, in file order, ``n`` at a time (the last batch may be short)."""
        for start in range(0, len(self.data), n):
            yield self.batch(range(start, min(start + n, len(self.data))))

    @property
    def epoch(self) -> int:
        return self.order.epoch

    def state_dict(self) -> dict[str, int]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state)


def _present(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message without the keys it does not have: Arrow gives every message of a column every
    key any of them has (None where absent), and a template testing ``is defined`` would see
    them."""
    return {k: v for k, v in message.items() if v is not None or k == "content"}
