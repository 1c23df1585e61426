"""The reference engine: plain PyTorch on a transformers model, data-parallel by all-reduce.

It exists to exercise the contracts (tests, conformance kit, parity reports). Each rank holds the
full model; gradients are summed across the DP group after the last micro-batch. It is not a
substitute for a sharded engine: use ``fsdp2`` for real training.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from engine_core._capsets import REFERENCE_CAPABILITIES
from engine_core.capabilities import Capability
from engine_core.checkpoint import commit_staging, staging_dir
from engine_core.config import EngineConfig
from engine_core.engine import BaseEngine
from engine_core.errors import CheckpointError
from engine_core.models import build_model
from engine_core.optim import build_lr_scheduler, build_optimizer, clip_and_step

__all__ = ["ReferenceEngine", "ReferenceEngineConfig"]

MODEL_FILE = "model.safetensors"


class ReferenceEngineConfig(EngineConfig):
    """The reference engine takes only the common engine fields."""


class ReferenceEngine(BaseEngine):
    capabilities: ClassVar[frozenset[Capability]] = REFERENCE_CAPABILITIES
    config_class: ClassVar[type[EngineConfig]] = ReferenceEngineConfig

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
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
        self.optimizer = build_optimizer(module.parameters(), self.config.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, self.config.optim)

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

    def optimizer_zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        assert self.optimizer is not None
        params = [p for p in self._require_module().parameters() if p.requires_grad]
        norm, skipped = clip_and_step(params, self.optimizer, self.config.optim.clip_grad)
        self.skipped_steps += int(skipped)
        return norm

    def lr_scheduler_step(self) -> float:
        assert self.scheduler is not None
        self.scheduler.step()
        return float(self.scheduler.get_last_lr()[0])

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
        folder = Path(path) / f"global_step_{step}.tmp"
        if rank == 0:
            assert tmp is not None
            save_file(
                {k: v.contiguous() for k, v in self._require_module().state_dict().items()},
                str(tmp / MODEL_FILE),
            )
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": step,
            "skipped_steps": self.skipped_steps,
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        }
        torch.save(state, folder / f"state_rank{rank}.pt")
        self._barrier()
        final = Path(path) / f"global_step_{step}"
        if rank == 0:
            final = commit_staging(path, step, max_ckpt_to_keep)
        self._barrier()
        return str(final)

    def load_checkpoint(self, path: str) -> int:
        folder = Path(path)
        model_file = folder / MODEL_FILE
        state_file = folder / f"state_rank{self.dp_rank}.pt"
        if not model_file.is_file() or not state_file.is_file():
            raise CheckpointError(
                f"{folder} is not a complete reference-engine checkpoint (need {MODEL_FILE} and "
                f"{state_file.name}); pass a global_step_<N> folder written by save_checkpoint()."
            )
        assert self.optimizer is not None and self.scheduler is not None
        self._require_module().load_state_dict(load_file(str(model_file)))
        state = torch.load(state_file, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_steps = state["skipped_steps"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
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
