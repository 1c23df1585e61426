"""The megatron engine's checkpoint files: :class:`MegatronCheckpoints`, a mixin of
:class:`~engine_core_megatron.engine.MegatronEngine`.

It fills the core's checkpoint sequence: model chunks and optimizer through megatron-core's
``dist_checkpointing`` under ``dist_ckpt/`` (a local filesystem only), the preflight refusals,
the tensor-parallel RNG tracker's streams and the LR-schedule state.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from engine_core.backend import (
    CheckpointError,
    is_dir,
    join,
)
from engine_core_megatron._device import on_device

__all__ = ["CKPT_DIR", "MegatronCheckpoints"]

CKPT_DIR = "dist_ckpt"
# megatron-core's file writers log a failed write (a full disk, a read-only folder) at ERROR and
# raise it; the job reports what is raised as one sentence, so that log line is held back
_WRITER_LOG = "megatron.core.dist_checkpointing.strategies.filesystem_async"


@contextlib.contextmanager
def _writers_quiet() -> Iterator[None]:
    logger = logging.getLogger(_WRITER_LOG)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class MegatronCheckpoints:
    """Save and restore the megatron engine's shards, RNG tracker and schedule state."""

    def _sharded_state_dict(self, *, is_loading: bool) -> dict[str, Any]:
        model_sd: dict[str, Any] = {}
        for i, chunk in enumerate(self.chunks):
            model_sd[f"model{i}"] = chunk.module.sharded_state_dict()
        merged: dict[str, Any] = {}
        for sd in model_sd.values():
            merged.update(sd)
        optim_sd = self.optimizer.sharded_state_dict(merged, is_loading=is_loading)
        return {**model_sd, "optimizer": optim_sd}

    def checkpoint_preflight(self, path: str, *, saving: bool) -> None:
        _require_local(path)
        self._refuse_distributed_optimizer_checkpoint("save" if saving else "load")
        if saving and not any(
            sub.optimizer.state
            for sub in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        ):
            raise CheckpointError(
                "megatron: cannot save a checkpoint before the first optimizer step: "
                "megatron-core has no optimizer state until a step has run, and a checkpoint "
                "without it does not load. Save after a step, or write the weights alone with "
                "export_hf()."
            )

    @on_device
    def save_shards(self, folder: str) -> None:
        from megatron.core import dist_checkpointing

        if dist.get_rank() == 0:
            os.makedirs(join(folder, CKPT_DIR), exist_ok=True)
        dist.barrier()
        with _writers_quiet():  # a failed write is raised, and reported once, by the job
            dist_checkpointing.save(
                self._sharded_state_dict(is_loading=False), join(folder, CKPT_DIR)
            )

    def _refuse_distributed_optimizer_checkpoint(self, what: str) -> None:
        if self.config.use_distributed_optimizer:  # type: ignore[attr-defined]
            raise CheckpointError(
                f"megatron: cannot {what} a checkpoint with use_distributed_optimizer=true. "
                f"megatron-core 0.16's distributed-optimizer checkpoints do not round-trip with "
                f"PyTorch's AdamW (no Apex or TransformerEngine optimizer): its default format "
                f"is refused by its own checkpointing, 'fully_reshardable' fails to load, and "
                f"'dp_reshardable' resumes with a different optimizer state. Train with "
                f"use_distributed_optimizer=false when the run saves checkpoints."
            )

    @on_device
    def load_shards(self, folder: str) -> None:
        from megatron.core import dist_checkpointing

        if not is_dir(join(folder, CKPT_DIR)):
            raise CheckpointError(
                f"{folder} is not a complete megatron checkpoint (no {CKPT_DIR}/); pass a "
                f"global_step_<N> folder written by save_checkpoint()."
            )
        state = dist_checkpointing.load(
            self._sharded_state_dict(is_loading=True), join(folder, CKPT_DIR)
        )
        for i, chunk in enumerate(self.chunks):
            chunk.module.load_state_dict(state[f"model{i}"])
        self.optimizer.load_state_dict(state["optimizer"])

    def rng_state(self) -> dict[str, Any]:
        state = super().rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # the tensor-parallel streams (dropout inside TP regions) of megatron's tracker
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            tracker = get_cuda_rng_tracker().get_states()
            state["megatron_tracker"] = {k: v.cpu() for k, v in tracker.items()}
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        super().set_rng_state(state)
        tracker = state.get("megatron_tracker")
        if tracker and torch.cuda.is_available():
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            get_cuda_rng_tracker().set_states(tracker)

    def checkpoint_extra_state(self) -> dict[str, Any]:
        return {"lr_step": self._lr_step, "skipped_steps": self.skipped_steps}

    def load_checkpoint_extra_state(self, state: dict[str, Any]) -> None:
        try:
            self._lr_step = int(state["lr_step"])
            self.skipped_steps = int(state["skipped_steps"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"the checkpoint's LR-schedule state is missing or malformed ({e!r}); it was not "
                f"written by the megatron engine's save_checkpoint(). Resume from another "
                f"checkpoint."
            ) from e
        self._apply_lr()


def _require_local(path: str) -> None:
    if "://" in str(path) and not str(path).startswith("file://"):
        raise CheckpointError(
            f"megatron: checkpoints are written with megatron-core's dist_checkpointing, which "
            f"needs a local or mounted filesystem; got {path!r}. Use a local path."
        )
