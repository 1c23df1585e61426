"""Datasets read from files, and the order their rows are drawn in: :func:`read_parts` reads
JSONL/JSON, Parquet or folders saved with ``datasets``' ``save_to_disk`` with the ``datasets``
library (memory-mapped Arrow); :class:`SeededOrder` hands out row indices in a seeded order,
epoch after epoch, and its position is a small dict a job's checkpoint keeps. Prompt datasets
(:mod:`~engine_core_roles.data.datasets.prompts`) and chat datasets (:mod:`~engine_core_roles.data.datasets.chats`)
are both read and drawn this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, PositiveInt, field_validator

from engine_core.config import Seeded
from engine_core.errors import ConfigError

__all__ = ["FilesConfig", "one_or_many", "read_parts", "read_rows", "concatenate", "SeededOrder"]


def one_or_many(v: Any) -> Any:
    """A list setting given one string (``data.train_files=a.jsonl``) as a list of it."""
    return [v] if isinstance(v, str) else v


class FilesConfig(Seeded):
    """The files of a dataset and the order their rows are drawn in: the settings prompt and
    chat datasets share. ``seed``: the shuffled order (epoch ``e`` uses ``seed + e``)."""

    train_files: list[str] = Field(
        ...,
        description="JSONL/JSON, Parquet files, or folders saved with datasets' save_to_disk; "
        "one example a row.",
    )
    val_files: list[str] = Field(
        default_factory=list, description="Validation rows, read as train_files are."
    )
    shuffle: bool = True
    max_image_pixels: PositiveInt | None = Field(
        None,
        description="Rows with images: an image of more pixels (width x height) is refused, "
        "with its file and row (None: any size; the model's image processor resizes within "
        "its own budget).",
    )

    _one_or_many = field_validator("train_files", "val_files", mode="before")(one_or_many)

    @field_validator("train_files")
    @classmethod
    def _some(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("data.train_files is empty; give at least one file or folder.")
        return v


def read_parts(files: Sequence[str], what: str, *, rows: str = "prompts") -> list[tuple[str, Any]]:
    """``(file, datasets.Dataset)`` for every file or folder in ``files``, in order; ``what``
    names the setting in errors, ``rows`` what a row is."""
    import datasets

    datasets.disable_progress_bars()
    parts = []
    for name in files:
        path = Path(name).expanduser()
        if not path.exists():
            raise ConfigError(f"{what}: {path} does not exist; give existing files or folders.")
        if path.is_file() and path.stat().st_size == 0:
            raise ConfigError(
                f"{what}: {path} is empty: it holds no rows; give a file with {rows}."
            )
        try:
            if path.is_dir():
                loaded = datasets.load_from_disk(str(path))
                if isinstance(loaded, datasets.DatasetDict):
                    split = "train" if "train" in loaded else next(iter(loaded))
                    loaded = loaded[split]
            elif path.suffix in (".jsonl", ".json"):
                loaded = datasets.load_dataset("json", data_files=str(path), split="train")
            elif path.suffix == ".parquet":
                loaded = datasets.load_dataset("parquet", data_files=str(path), split="train")
            else:
                raise ConfigError(
                    f"{what}: {path} is neither .jsonl/.json, .parquet nor a saved datasets "
                    f"folder; convert it to one of those."
                )
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"{what}: {path} could not be read: {type(e).__name__}: {e}") from e
        parts.append((str(path), loaded))
    return parts


def read_rows(files: Sequence[str], what: str, *, rows: str = "prompts") -> Any:
    """One ``datasets.Dataset`` of every file/folder in ``files`` (concatenated)."""
    return concatenate(read_parts(files, what, rows=rows), files, what, rows=rows)


def concatenate(
    parts: list[tuple[str, Any]], files: Sequence[str], what: str, *, rows: str = "prompts"
) -> Any:
    """The parts of :func:`read_parts` as one dataset; refused when it holds no row."""
    import datasets

    data = parts[0][1] if len(parts) == 1 else datasets.concatenate_datasets([p for _, p in parts])
    if len(data) == 0:
        raise ConfigError(f"{what}: {', '.join(files)} holds no rows; give a file with {rows}.")
    return data


class SeededOrder:
    """Row indices of a dataset of ``size`` rows, epoch after epoch: each epoch a new
    permutation (``seed + epoch``) when shuffling, file order otherwise.

    :meth:`state_dict` / :meth:`load_state_dict` are the position (epoch, index, and the row
    count it was taken on, checked on load).
    """

    def __init__(self, size: int, *, shuffle: bool, seed: int, what: str, rows: str) -> None:
        self.size, self.shuffle, self.seed, self.what, self.rows = size, shuffle, seed, what, rows
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=gen).tolist()

    def next_indices(self, n: int) -> list[int]:
        """The next ``n`` rows in draw order (into the next epoch when this one runs out)."""
        out: list[int] = []
        while len(out) < n:
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = self._order[self.index : self.index + n - len(out)]
            out += take
            self.index += len(take)
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "rows": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("rows", self.size)) != self.size:
            raise ConfigError(
                f"the checkpoint's dataset position is for {state['rows']} {self.rows}, but "
                f"{self.what} now holds {self.size}; resume with the same files and data "
                f"settings, or start a new run."
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)
