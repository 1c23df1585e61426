"""Checkpoint folder layout shared by engines: ``<root>/global_step_<N>/``, staged, rotated.

``root`` is a local path or any URL fsspec understands (``s3://``, ``gs://``, ``memory://``,
...). A checkpoint is written into a temporary sibling folder (``global_step_<N>.tmp``) and moved
into place only when complete, so an interrupted save never leaves a half-written
``global_step_<N>`` and never touches an existing one. On local and POSIX filesystems the move is
an atomic rename; on object stores it is a copy then delete, and the ``.tmp`` name keeps an
unfinished move out of :func:`list_checkpoints`. Rotation deletes the oldest complete
checkpoints beyond the limit.

The small I/O helpers (``save_torch``, ``load_torch``, ``save_safetensors``, ``load_safetensors``,
``is_file``, ``is_dir``) take the same kind of location, so engines never assume a local disk.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from engine_core.errors import CheckpointError

__all__ = [
    "STEP_DIR_PATTERN",
    "join",
    "step_dir",
    "list_checkpoints",
    "latest_checkpoint",
    "rotate",
    "staging_dir",
    "commit_staging",
    "is_file",
    "is_dir",
    "save_torch",
    "load_torch",
    "save_safetensors",
    "load_safetensors",
    "replace_folder",
    "fresh_folder",
]

STEP_DIR_PATTERN = re.compile(r"^global_step_(\d+)$")


def _fs(location: str | Path) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(str(location))
    return fs, path


def _is_local(location: str | Path) -> bool:
    return isinstance(_fs(location)[0], LocalFileSystem)


def join(location: str | Path, *names: str) -> str:
    """``location/name/...`` for a local path or a URL (no normalisation beyond slashes)."""
    out = str(location).rstrip("/")
    for name in names:
        out = f"{out}/{name}"
    return out


def step_dir(root: str | Path, step: int) -> str:
    if step < 0:
        raise CheckpointError(f"checkpoint step must be >= 0, got {step}.")
    return join(root, f"global_step_{step}")


def is_file(location: str | Path) -> bool:
    fs, path = _fs(location)
    return bool(fs.isfile(path))


def is_dir(location: str | Path) -> bool:
    fs, path = _fs(location)
    return bool(fs.isdir(path))


def list_checkpoints(root: str | Path) -> list[tuple[int, str]]:
    """Complete checkpoints under ``root`` as (step, location), oldest first."""
    fs, path = _fs(root)
    if not fs.isdir(path):
        return []
    found = []
    for entry in fs.ls(path, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        m = STEP_DIR_PATTERN.match(name)
        if m and entry["type"] == "directory":
            found.append((int(m.group(1)), join(root, name)))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> str | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def staging_dir(root: str | Path, step: int) -> str:
    """A fresh temporary folder to write step ``step`` into; refuses to overwrite a checkpoint."""
    final = step_dir(root, step)
    fs, final_path = _fs(final)
    if fs.exists(final_path):
        raise CheckpointError(
            f"checkpoint {final} already exists; refusing to overwrite it. Save under a new step "
            f"or another root, or delete it yourself."
        )
    tmp = final + ".tmp"
    tmp_path = final_path + ".tmp"
    if fs.exists(tmp_path):  # leftover of an interrupted save: never a complete checkpoint
        fs.rm(tmp_path, recursive=True)
    fs.makedirs(tmp_path, exist_ok=True)
    return tmp


def commit_staging(root: str | Path, step: int, max_ckpt_to_keep: int | None) -> str:
    """Move the staged folder into place, then rotate old checkpoints."""
    final = step_dir(root, step)
    fs, final_path = _fs(final)
    fs.mv(final_path + ".tmp", final_path, recursive=True)
    rotate(root, max_ckpt_to_keep)
    return final


def rotate(root: str | Path, max_ckpt_to_keep: int | None) -> list[str]:
    """Delete the oldest checkpoints so at most ``max_ckpt_to_keep`` remain; return those deleted."""
    if max_ckpt_to_keep is None:
        return []
    if max_ckpt_to_keep < 1:
        raise CheckpointError(f"max_ckpt_to_keep must be >= 1 or None, got {max_ckpt_to_keep}.")
    found = list_checkpoints(root)
    doomed = [loc for _, loc in found[: max(len(found) - max_ckpt_to_keep, 0)]]
    for loc in doomed:
        fs, path = _fs(loc)
        fs.rm(path, recursive=True)
    return doomed


def replace_folder(staged: str, final: str) -> None:
    """Swap a completely written ``staged`` folder in at ``final``, replacing what was there."""
    fs, final_path = _fs(final)
    _, staged_path = _fs(staged)
    old = final_path + ".old"
    if fs.exists(old):
        fs.rm(old, recursive=True)
    if fs.exists(final_path):
        fs.mv(final_path, old, recursive=True)
    fs.mv(staged_path, final_path, recursive=True)
    if fs.exists(old):
        fs.rm(old, recursive=True)


def fresh_folder(location: str) -> None:
    """Create ``location`` empty (removing a leftover of an interrupted write)."""
    fs, path = _fs(location)
    if fs.exists(path):
        fs.rm(path, recursive=True)
    fs.makedirs(path, exist_ok=True)


def save_torch(obj: Any, location: str | Path) -> None:
    with fsspec.open(str(location), "wb") as f:
        torch.save(obj, f)


def load_torch(location: str | Path) -> Any:
    with fsspec.open(str(location), "rb") as f:
        data = f.read()
    # our own files (optimizer state, RNG, schedule): not untrusted input
    return torch.load(io.BytesIO(data), weights_only=False)


def save_safetensors(
    tensors: dict[str, torch.Tensor], location: str, metadata: dict[str, str] | None = None
) -> None:
    from safetensors.torch import save, save_file

    if _is_local(location):
        save_file(tensors, _fs(location)[1], metadata=metadata)  # streams to disk
        return
    fs, path = _fs(location)
    fs.pipe_file(path, save(tensors, metadata=metadata))


def load_safetensors(location: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load, load_file

    if _is_local(location):
        return load_file(_fs(location)[1])
    fs, path = _fs(location)
    return load(fs.cat_file(path))
