"""The reference engine: plain PyTorch on a transformers model, data-parallel by all-reduce.

It exists to exercise the contracts (tests, conformance kit, parity reports). Each rank holds the
full model; gradients are summed across the DP group after the last micro-batch. It is not a
substitute for a sharded engine: use ``fsdp2`` for real training.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch
import torch.distributed as dist

from engine_core._capsets import REFERENCE_CAPABILITIES
from engine_core.capabilities import Capability
from engine_core.checkpoint import (
    commit_staging,
    is_file,
    join,
    load_safetensors,
    load_torch,
    save_safetensors,
    save_torch,
    staging_dir,
    step_dir,
)
from engine_core.config import EngineConfig
from engine_core.engine import BaseEngine
from engine_core.errors import CheckpointError
from engine_core.models import build_model
from engine_core.optim import SingleOptimizerMixin

__all__ = ["ReferenceEngine", "ReferenceEngineConfig"]

MODEL_FILE = "model.safetensors"


class ReferenceEngineConfig(EngineConfig):
    """The reference engine takes only the common engine fields."""


class ReferenceEngine(SingleOptimizerMixin, BaseEngine):
    capabilities: ClassVar[frozenset[Capability]] = REFERENCE_CAPABILITIES
    config_class: ClassVar[type[EngineConfig]] = ReferenceEngineConfig

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.optimizer = None
        self.scheduler = None
        self.skipped_steps = 0

    def init_model(self) -> None:
        torch.manual_seed(self.config.seed)
        module = build_model(self.config.model, device=self.device)
        if self._distributed and self.dp_size > 1:
            # identical replicas: rank 0's initialisation wins
            for t in module.state_dict().values():
                dist.broadcast(
                    t,
                    src=dist.get_global_rank(self.dp_group, 0) if self.dp_group else 0,
                    group=self.dp_group,
                )
        self.module = module
        self.init_optimizer(module)

    def finish_backward(self) -> None:
        if not (self._distributed and self.dp_size > 1):
            return
        grads = [p.grad for p in self._require_module().parameters() if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)  # SUM: losses are globally normalized
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def to(self, device: torch.device | str, *, model: bool = True, optimizer: bool = True) -> None:
        dev = torch.device(device)
        if model:
            self._require_module().to(dev)
        if optimizer and self.optimizer is not None:
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        state[k] = v.to(dev)

    def save_checkpoint(self, path: str, *, step: int, max_ckpt_to_keep: int | None = None) -> str:
        assert self.optimizer is not None and self.scheduler is not None
        rank = self.dp_rank
        tmp = staging_dir(path, step) if rank == 0 else None
        self._barrier()
        folder = step_dir(path, step) + ".tmp"
        if rank == 0:
            assert tmp is not None
            save_safetensors(
                {k: v.contiguous() for k, v in self._require_module().state_dict().items()},
                join(tmp, MODEL_FILE),
            )
        state = {
            "optimizer": self.optimizer.state_dict(),
            "step": step,
            **self.optimizer_extra_state(),
        }
        save_torch(state, join(folder, f"state_rank{rank}.pt"))
        self._barrier()
        final = step_dir(path, step)
        if rank == 0:
            final = commit_staging(path, step, max_ckpt_to_keep)
        self._barrier()
        return str(final)

    def load_checkpoint(self, path: str) -> int:
        model_file = join(path, MODEL_FILE)
        state_name = f"state_rank{self.dp_rank}.pt"
        state_file = join(path, state_name)
        if not is_file(model_file) or not is_file(state_file):
            raise CheckpointError(
                f"{path} is not a complete reference-engine checkpoint (need {MODEL_FILE} and "
                f"{state_name}); pass a global_step_<N> folder written by save_checkpoint()."
            )
        assert self.optimizer is not None and self.scheduler is not None
        self._require_module().load_state_dict(load_safetensors(model_file))
        state = load_torch(state_file)
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_optimizer_extra_state(state)
        return int(state["step"])

    def named_full_params(
        self, bucket_bytes: int = 512 << 20
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # Replicated weights: every tensor is already full, nothing to materialise.
        for name, tensor in self._require_module().state_dict().items():
            yield name, tensor.detach()

    def _barrier(self) -> None:
        if self._distributed and self.dp_size > 1:
            dist.barrier(group=self.dp_group)
