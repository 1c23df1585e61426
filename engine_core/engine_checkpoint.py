"""The engine's checkpoint sequence: :class:`EngineCheckpoints`, a mixin of
:class:`~engine_core.engine.BaseEngine`.

It owns what every engine does the same way (staging, the core state file of each rank with
its step, world size and RNG streams, verification against the manifest, the restore order) and
the override points a backend fills: :meth:`~EngineCheckpoints.save_shards`,
:meth:`~EngineCheckpoints.load_shards`, :meth:`~EngineCheckpoints.checkpoint_preflight`, the
extra state and the RNG streams. The commit itself (manifest, rename, rotation) is
:class:`~engine_core.checkpoint.JobCheckpoints`'.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from engine_core.checkpoint import JOB_STATE_FILE

if TYPE_CHECKING:
    from torch import nn

# each rank's core state in a checkpoint folder: step, world size, RNG streams, extra state
CHECKPOINT_STATE_FILE = "engine_state_rank{rank}.pt"

__all__ = ["CHECKPOINT_STATE_FILE", "JOB_STATE_FILE", "EngineCheckpoints"]


def _cause(e: BaseException) -> str:
    """One line saying why a backend's loader failed: its exception's type and first line, or
    for a distributed-checkpoint failure those of the lowest failing rank's own exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:
        e = e.failures[min(e.failures)][0]
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class EngineCheckpoints(abc.ABC):
    """Save and restore an engine: the core's sequence around the backend's shards."""

    if TYPE_CHECKING:  # provided by BaseEngine

        @property
        def is_distributed(self) -> bool: ...

        def require_module(self) -> nn.Module: ...

    def save_checkpoint(
        self,
        path: str,
        *,
        step: int,
        max_ckpt_to_keep: int | None = None,
        job_state: dict[str, Any] | None = None,
    ) -> str:
        """Save everything a resume needs as ``<path>/global_step_<step>``; return that folder.

        Collective: every rank calls it. The sequence is the core's, the same for every engine:
        the input is checked and :meth:`checkpoint_preflight` runs (nothing written yet); global
        rank 0 creates the staging folder ``global_step_<step>.tmp``; every rank writes its part
        with :meth:`save_shards` and its core state file (``step``, the RNG streams of
        :meth:`rng_state`, :meth:`checkpoint_extra_state`); rank 0 writes ``job_state`` (plain
        data of the caller's, e.g. a job's data position: committed together with the engine's
        state, read back with :func:`load_job_state`) and, last, the manifest (every file's size
        and SHA-256), renames the folder into place and deletes the oldest checkpoints beyond
        ``max_ckpt_to_keep``. An interrupted save leaves only a ``.tmp`` folder, which
        :func:`~engine_core.checkpoint.list_checkpoints` ignores; an existing checkpoint is never
        overwritten; :meth:`load_checkpoint` verifies every file against the manifest.
        """
        from engine_core.checkpoint import ROOT_PART, JobCheckpoints

        self.require_module()
        # a single engine is a job of one part, its files at the folder's root
        return JobCheckpoints(path, max_ckpt_to_keep=max_ckpt_to_keep).save(
            step, {ROOT_PART: self}, job_state, where="save_checkpoint"
        )

    def write_checkpoint_files(self, folder: str, *, step: int) -> None:
        """Write this engine's checkpoint files into ``folder`` (created if missing): every
        rank's shards (:meth:`save_shards`) and core state file. Collective; returns when every
        rank is done.

        No staging, manifest or commit: :meth:`save_checkpoint` wraps it in those. A caller that
        commits several engines' state as one checkpoint (an actor and a critic, say: see
        :class:`~engine_core.checkpoint.JobCheckpoints`) writes each engine into a subfolder of
        its own staging folder and commits once.
        """
        from engine_core.checkpoint import _fs, join, save_torch

        self.require_module()
        rank, world = self._global_rank_and_size()
        if rank == 0:
            fs, local = _fs(folder)
            fs.makedirs(local, exist_ok=True)
        self._checkpoint_barrier()
        self.save_shards(folder)
        core = {
            "step": step,
            "world_size": world,
            "rng": self.rng_state(),
            "engine": self.checkpoint_extra_state(),
        }
        save_torch(core, join(folder, CHECKPOINT_STATE_FILE.format(rank=rank)))
        self._checkpoint_barrier()

    def load_checkpoint(self, path: str) -> int:
        """Restore everything :meth:`save_checkpoint` wrote in the folder ``path``; return its step.

        Collective. Every file is verified against the checkpoint's manifest first (the files
        split by size between the global ranks, each hashing its share at once; a damaged,
        truncated or changed file is a
        :class:`~engine_core.errors.CheckpointError` naming it, on every rank, before any state
        changes). The core state file is read and checked, then :meth:`load_shards` restores
        model and optimizer, then :meth:`load_checkpoint_extra_state` and, when the checkpoint
        was written by the same number of ranks, each rank's RNG streams (a resharded load keeps
        its own: streams belong to ranks).
        """
        from engine_core.checkpoint import verify_on_every_rank

        self.require_module()
        self.checkpoint_preflight(path, saving=False)
        verify_on_every_rank(path)
        return self.read_checkpoint_files(path)

    def read_checkpoint_files(self, folder: str) -> int:
        """Restore what :meth:`write_checkpoint_files` wrote in ``folder``; return its step.

        Collective. Does not verify the files: :meth:`load_checkpoint` verifies the folder
        against its manifest first, and a caller that committed several engines as one
        checkpoint verifies that checkpoint's manifest (:meth:`JobCheckpoints.verify
        <engine_core.checkpoint.JobCheckpoints.verify>`) before reading each engine's part.
        """
        from engine_core.checkpoint import is_file, join, load_torch
        from engine_core.errors import CheckpointError

        self.require_module()
        rank, world = self._global_rank_and_size()
        first = join(folder, CHECKPOINT_STATE_FILE.format(rank=0))
        own = join(folder, CHECKPOINT_STATE_FILE.format(rank=rank))
        if not is_file(first):
            raise CheckpointError(
                f"{folder} is not a complete checkpoint (no {CHECKPOINT_STATE_FILE.format(rank=0)}); "
                f"pass a global_step_<N> folder written by save_checkpoint()."
            )
        core = load_torch(own if is_file(own) else first)
        step, saved_world = core.get("step"), core.get("world_size")
        if not isinstance(step, int) or not isinstance(saved_world, int) or "rng" not in core:
            raise CheckpointError(
                f"{folder}: the core state file lacks step, world_size or rng; it was not written "
                f"by save_checkpoint() of this engine-core version. Resume from another checkpoint."
            )
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            self.load_shards(folder)
        except CheckpointError:
            raise
        # the backend's loader; a distributed-checkpoint failure is a BaseException of its own
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"checkpoint {folder} (step {step}) does not fit this {type(self).__name__}'s model "
                f"({_cause(e)}). Resume with the model config, backend and layout it was saved "
                f"with (or one the backend reshards to)."
            ) from e
        self.load_checkpoint_extra_state(core.get("engine") or {})
        if saved_world == world and is_file(own):
            self.set_rng_state(core["rng"])
        return step

    @staticmethod
    def load_job_state(path: str) -> dict[str, Any] | None:
        """The ``job_state`` saved with the checkpoint folder ``path`` (``None`` if none was)."""
        from engine_core.checkpoint import is_file, join, load_torch

        location = join(path, JOB_STATE_FILE)
        return load_torch(location) if is_file(location) else None

    def checkpoint_preflight(self, path: str, *, saving: bool) -> None:
        """Refuse a save or load this engine cannot do, before anything is written or read.

        Default: nothing to refuse. Engines that need a local folder, or refuse a layout,
        raise :class:`~engine_core.errors.CheckpointError` here.
        """

    @abc.abstractmethod
    def save_shards(self, folder: str) -> None:
        """Write this rank's model and optimizer state into ``folder`` (the staging folder).

        Called on every rank inside :meth:`save_checkpoint`, after ``folder`` exists. Write
        rank-specific files under rank-specific names; collective writers
        (``torch.distributed.checkpoint``) are called by every rank.
        """

    @abc.abstractmethod
    def load_shards(self, folder: str) -> None:
        """Restore what :meth:`save_shards` wrote in ``folder`` (every rank); raise
        :class:`~engine_core.errors.CheckpointError` naming what is missing."""

    def checkpoint_extra_state(self) -> dict[str, Any]:
        """Plain data beyond model and optimizer that a resume needs (LR schedule, counters).

        Saved per rank in the core state file. ``SingleOptimizerMixin`` returns the schedule
        and the skipped-step count; an engine with a schedule of its own must return it here.
        """
        return {}

    def load_checkpoint_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`checkpoint_extra_state` returned."""

    def rng_state(self) -> dict[str, Any]:
        """The random streams a resume must continue: torch (CPU and the current CUDA device),
        numpy and Python. Engines with streams of their own (a tensor-parallel RNG tracker) add
        them."""
        from engine_core.optim import capture_rng

        return capture_rng()

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Set the streams :meth:`rng_state` recorded."""
        from engine_core.optim import restore_rng

        restore_rng(state)

    def _global_rank_and_size(self) -> tuple[int, int]:
        if self.is_distributed:
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _checkpoint_barrier(self) -> None:
        if self.is_distributed and dist.get_world_size() > 1:
            dist.barrier()
