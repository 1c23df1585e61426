"""Prompt datasets read from files: :class:`PromptData` reads JSONL, Parquet or saved ``datasets``
folders with the ``datasets`` library (memory-mapped Arrow), renders each prompt — chat messages
through the tokenizer's chat template with the generation prompt, text as it is — drops prompts
too long for the model (counted), and hands out batches in a seeded order, epoch after epoch; its
position is a small dict the job's checkpoint keeps.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, PositiveInt, field_validator, model_validator
from tensordict import NonTensorStack, TensorDict

from engine_core.errors import ConfigError
from engine_core.vision import vision_fields
from engine_core_roles.batch.build import prompt_batch
from engine_core_roles.batch.keys import ROW, ROW_INDEX
from engine_core_roles.data.datasets.files import (
    FilesConfig,
    SeededOrder,
    concatenate,
    one_or_many,
    read_parts,
)
from engine_core_roles.data.datasets.images import (
    ImagePromptRenderer,
    RenderedPrompt,
    image_parts,
)

__all__ = ["DataConfig", "PromptData"]

_IDS_COLUMN = "_engine_core_prompt_ids"


class DataConfig(FilesConfig):
    """Where the prompts come from (one a row) and how they are drawn."""

    prompt_key: str = Field(
        "prompt",
        description="The prompt column: a list of {role, content} messages (rendered with the "
        "chat template and its generation prompt) or a string (used as it is).",
    )
    chat_template: bool | None = Field(
        None,
        description="None: messages through the template, strings as they are; true: a string "
        "prompt becomes one user message; false: strings only.",
    )
    max_prompt_length: PositiveInt | None = Field(
        None,
        description="Longer prompts are dropped (counted); default: the model's context minus "
        "the response length.",
    )
    demos: list[str] = Field(
        default_factory=list,
        description="JSONL files of demonstrations ({'messages': [...]} ending with the "
        "assistant's answer) for the supervised warm-up (warmup_sft_steps): tokenized as the "
        "rollout samples (the prompt with the generation prompt, then the answer and its end "
        "of turn), trained on the answer's tokens only.",
    )

    _demos_one_or_many = field_validator("demos", mode="before")(one_or_many)

    @model_validator(mode="before")
    @classmethod
    def _stop_strings_are_the_trainers(cls, data: Any) -> Any:
        if isinstance(data, dict) and "stop_strings" in data:
            raise ValueError(
                f"data.stop_strings={data['stop_strings']!r}: stop strings are a sampling "
                f"setting, beside the stop token ids; set trainer.stop_strings instead (the "
                f"rollout stops on them as it generates)."
            )
        return data


class PromptData:
    """Rendered, length-filtered prompts of one dataset, drawn in a seeded order.

    ``rows`` of the file keep every column; the rendered token ids sit beside them. Batches
    are drawn epoch after epoch, each epoch a new permutation (``seed + epoch``) when
    shuffling; :meth:`state_dict` / :meth:`load_state_dict` are the position (epoch, index).
    """

    def __init__(
        self,
        files: Sequence[str],
        tokenizer: Any,
        cfg: DataConfig,
        *,
        max_length: int,
        what: str = "data.train_files",
        tools: list[dict[str, Any]] | None = None,
        rows: bool = False,
        images: ImagePromptRenderer | None = None,
    ) -> None:
        self.cfg, self.tokenizer, self.what, self.tools = cfg, tokenizer, what, tools
        self.with_rows = rows
        # prompts with images (ImagePromptRenderer): each row's file, for paths relative to it
        self.images = images
        parts = read_parts(files, what)
        self._sources: list[tuple[int, str]] = []  # (first row, file) of each part
        first = 0
        for name, part in parts:
            self._sources.append((first, name))
            first += len(part)
        data = concatenate(parts, files, what)
        if cfg.prompt_key not in data.column_names:
            raise ConfigError(
                f"{what}: no {cfg.prompt_key!r} column; the columns are "
                f"{', '.join(data.column_names)}. Set data.prompt_key to the prompt column."
            )
        fingerprint = hashlib.sha256(
            json.dumps(
                [
                    data._fingerprint,
                    cfg.prompt_key,
                    cfg.chat_template,
                    len(tokenizer),
                    tokenizer.chat_template,
                    tokenizer.name_or_path,
                    tools,
                ]
            ).encode()
        ).hexdigest()[:16]
        self._limit = max_length
        rendered = data.map(
            self._render_batch,
            batched=True,
            with_indices=True,
            # a prompt's ids depend on its images' sizes, which the fingerprint does not see
            load_from_cache_file=images is None,
            new_fingerprint=fingerprint,
            desc="rendering prompts",
        )
        lengths = rendered.with_format(None)[_IDS_COLUMN]
        keep = [i for i, ids in enumerate(lengths) if len(ids) <= max_length]
        self._rendered_index = keep  # the file row of each kept prompt
        self.total, self.dropped, self.max_length = (
            len(rendered),
            len(rendered) - len(keep),
            max_length,
        )
        if not keep:
            raise ConfigError(
                f"{what}: all {self.total} prompts are longer than {max_length} tokens (the "
                f"model's context minus the response length); shorten the prompts, raise "
                f"data.max_prompt_length, or use a model with a longer context."
            )
        self.data = rendered if not self.dropped else rendered.select(keep)
        self.columns = [c for c in data.column_names if c != cfg.prompt_key]
        # views, selected once: a step reads its rows' ids and other columns through them
        self._ids = self.data.select_columns([_IDS_COLUMN])
        self._other = self.data.select_columns(self.columns) if self.columns else None
        self._whole = self.data.select_columns(list(data.column_names))
        self._prompts = self.data.select_columns([cfg.prompt_key])
        self.order = SeededOrder(
            len(self.data), shuffle=cfg.shuffle, seed=cfg.seed, what=what, rows="prompts"
        )

    def __len__(self) -> int:
        return len(self.data)

    def _where(self, index: int) -> tuple[str, int]:
        """The file row ``index`` (of the files together) comes from, and its row there."""
        first, name = next((f, n) for f, n in reversed(self._sources) if f <= index)
        return name, index - first

    def _render_pictured(self, prompt: Any, index: int) -> RenderedPrompt:
        """A prompt with images through :attr:`images` (its paths relative to its file)."""
        assert self.images is not None  # the callers check
        name, row = self._where(index)
        where = f"{self.what}: {name}, row {row}"
        return self.images.render(
            prompt,
            base=Path(name).parent,
            where=where,
            max_length=self._limit,
            tools=self.tools,
        )

    def render(self, prompt: Any, index: int | None = None) -> list[int]:
        """One prompt's token ids: messages through the chat template (generation prompt
        added), a string as it is; messages with images through the renderer of images
        (``index``: the row, for the file its image paths are relative to)."""
        if isinstance(prompt, list) and image_parts(prompt):
            if self.images is None:
                raise ConfigError(
                    f"{self.what}: a prompt holds images and the model is a text model; train "
                    f"a vision-language model (engine.model.path with its image processor)."
                )
            return list(self._render_pictured(prompt, index or 0).ids)
        use_template = self.cfg.chat_template
        if isinstance(prompt, str) and use_template:
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if use_template is False:
            raise ConfigError(
                f"{self.what}: a prompt is a list of messages but data.chat_template=false; "
                f"set it to null or true."
            )
        if not isinstance(prompt, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt
        ):
            raise ConfigError(
                f"{self.what}: a {self.cfg.prompt_key!r} value is {str(prompt)[:80]!r}; a prompt "
                f"is a string or a list of {{'role', 'content'}} messages."
            )
        if not self.tokenizer.chat_template:
            raise ConfigError(
                f"{self.what}: prompts are chat messages but the tokenizer has no chat "
                f"template; save one with the tokenizer, or give text prompts."
            )
        ids = self.tokenizer.apply_chat_template(
            prompt, tools=self.tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def _render_batch(
        self, batch: dict[str, list[Any]], indices: list[int]
    ) -> dict[str, list[Any]]:
        prompts = batch[self.cfg.prompt_key]
        return {_IDS_COLUMN: [self.render(p, i) for p, i in zip(prompts, indices, strict=True)]}

    def _images_of(self, indices: Sequence[int]) -> dict[str, torch.Tensor] | None:
        """The batch fields of these prompts' images (None when none has any). Read and
        processed for each batch, as a data loader does, not kept: a dataset's pixels would
        otherwise fill memory over an epoch."""
        if self.images is None:
            return None
        pixels: list[torch.Tensor | None] = []
        grids: list[torch.Tensor | None] = []
        prompts = self._prompts[list(indices)][self.cfg.prompt_key]
        for i, prompt in zip(indices, prompts, strict=True):
            out = None
            if isinstance(prompt, list) and image_parts(prompt):
                out = self._render_pictured(prompt, self._rendered_index[i])
            pixels.append(None if out is None else out.pixel_values)
            grids.append(None if out is None else out.grids)
        if all(p is None for p in pixels):
            return None
        return vision_fields(pixels, grids)

    def next_indices(self, n: int) -> list[int]:
        """The next ``n`` rows in draw order (into the next epoch when this one runs out)."""
        return self.order.next_indices(n)

    @property
    def epoch(self) -> int:
        return self.order.epoch

    def batch(self, indices: Sequence[int]) -> TensorDict:
        """The prompt batch of these rows: left-padded ids, mask and ``row_index``; built with
        ``rows=True``, each whole row too (a dict per prompt under
        :data:`~engine_core_roles.batch.keys.ROW`, which an episode's environment starts from)."""
        ids = self._ids[list(indices)][_IDS_COLUMN]
        out = prompt_batch(ids, pad_token_id=int(self.tokenizer.pad_token_id))
        out[ROW_INDEX] = torch.tensor(list(indices), dtype=torch.long)
        pictured = self._images_of(indices)
        if pictured is not None:  # each prompt's images, beside its ids
            for key, value in pictured.items():
                out[key] = value
        if self.with_rows:
            table = self._whole[list(indices)]
            out[ROW] = NonTensorStack.from_list(
                [{c: table[c][i] for c in table} for i in range(len(indices))]
            )
        return out

    def next_batch(self, n: int) -> TensorDict:
        return self.batch(self.next_indices(n))

    def batches(self, n: int) -> Iterator[TensorDict]:
        """Every row once, in file order, ``n`` at a time (the last batch may be short)."""
        for start in range(0, len(self.data), n):
            yield self.batch(range(start, min(start + n, len(self.data))))

    def rows(self, indices: Sequence[int]) -> dict[str, list[Any]]:
        """The other columns of these rows, one list per column."""
        if self._other is None:
            return {}
        return self._other[list(indices)]  # type: ignore[no-any-return]

    def state_dict(self) -> dict[str, int]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state)
