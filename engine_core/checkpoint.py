"""Checkpoint folder layout shared by engines: ``<root>/global_step_<N>/``, atomic, rotated.

A checkpoint is written into a temporary sibling folder and renamed into place only when
complete, so an interrupted save never leaves a half-written ``global_step_<N>`` and never
touches an existing one. Rotation deletes the oldest complete checkpoints beyond the limit.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from engine_core.errors import CheckpointError

__all__ = [
    "STEP_DIR_PATTERN",
    "step_dir",
    "list_checkpoints",
    "latest_checkpoint",
    "rotate",
    "staging_dir",
    "commit_staging",
]

STEP_DIR_PATTERN = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    if step < 0:
        raise CheckpointError(f"checkpoint step must be >= 0, got {step}.")
    return Path(root) / f"global_step_{step}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, folder), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = STEP_DIR_PATTERN.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def staging_dir(root: str | Path, step: int) -> Path:
    """A fresh temporary folder to write step ``step`` into; refuses to overwrite a checkpoint."""
    final = step_dir(root, step)
    if final.exists():
        raise CheckpointError(
            f"checkpoint {final} already exists; refusing to overwrite it. Save under a new step "
            f"or another root, or delete it yourself."
        )
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():  # leftover of an interrupted save: never a complete checkpoint
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_staging(root: str | Path, step: int, max_ckpt_to_keep: int | None) -> Path:
    """Rename the staged folder into place, then rotate old checkpoints."""
    final = step_dir(root, step)
    final.with_name(final.name + ".tmp").rename(final)
    rotate(root, max_ckpt_to_keep)
    return final


def rotate(root: str | Path, max_ckpt_to_keep: int | None) -> list[Path]:
    """Delete the oldest checkpoints so at most ``max_ckpt_to_keep`` remain; return those deleted."""
    if max_ckpt_to_keep is None:
        return []
    if max_ckpt_to_keep < 1:
        raise CheckpointError(f"max_ckpt_to_keep must be >= 1 or None, got {max_ckpt_to_keep}.")
    found = list_checkpoints(root)
    doomed = [p for _, p in found[: max(len(found) - max_ckpt_to_keep, 0)]]
    for p in doomed:
        shutil.rmtree(p)
    return doomed
