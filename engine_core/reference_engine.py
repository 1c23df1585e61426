"""The reference engine: plain PyTorch on a transformers model, data-parallel by all-reduce.

It exists to exercise the contracts (tests, conformance kit, parity reports). Each rank holds the
full model; gradients are summed across the DP group after the last micro-batch. It is not a
substitute for a sharded engine: use ``fsdp2`` for real training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from engine_core._capsets import REFERENCE_CAPABILITIES
from engine_core.capabilities import Capability
from engine_core.checkpoint import (
    is_file,
    join,
    load_safetensors,
    load_torch,
    save_safetensors,
    save_torch,
)
from engine_core.config import BUCKET_BYTES, EngineConfig
from engine_core.engine import BaseEngine
from engine_core.errors import CheckpointError
from engine_core.models import DTYPES, build_model
from engine_core.optim import SingleOptimizerMixin

__all__ = ["ReferenceEngine", "ReferenceEngineConfig"]

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim_rank{rank}.pt"


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
        if self.is_distributed and self.dp_size > 1:
            # identical replicas: rank 0's initialisation wins
            for t in module.state_dict().values():
                dist.broadcast(
                    t,
                    src=dist.get_global_rank(self.dp_group, 0) if self.dp_group else 0,
                    group=self.dp_group,
                )
        self.module = module
        self.init_optimizer(module)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        # mixed precision: the weights stay in model.dtype, the model's ops autocast
        if self.config.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.config.compute_dtype])

    def finish_backward(self) -> None:
        if not (self.is_distributed and self.dp_size > 1):
            return
        grads = [p.grad for p in self.require_module().parameters() if p.grad is not None]
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
            self.require_module().to(dev)
        if optimizer and self.optimizer is not None:
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        state[k] = v.to(dev)

    def save_shards(self, folder: str) -> None:
        assert self.optimizer is not None, "call init_model() first"
        rank = self.dp_rank
        if rank == 0:  # replicas are identical: one copy of the weights
            save_safetensors(
                {k: v.contiguous() for k, v in self.require_module().state_dict().items()},
                join(folder, MODEL_FILE),
            )
        save_torch(
            {"optimizer": self.optimizer.state_dict()}, join(folder, OPTIM_FILE.format(rank=rank))
        )

    def load_shards(self, folder: str) -> None:
        assert self.optimizer is not None, "call init_model() first"
        model_file = join(folder, MODEL_FILE)
        optim_name = OPTIM_FILE.format(rank=self.dp_rank)
        optim_file = join(folder, optim_name)
        if not is_file(model_file) or not is_file(optim_file):
            raise CheckpointError(
                f"{folder} is not a complete reference-engine checkpoint (need {MODEL_FILE} and "
                f"{optim_name}); pass a global_step_<N> folder written by save_checkpoint()."
            )
        self.require_module().load_state_dict(load_safetensors(model_file))
        self.optimizer.load_state_dict(load_torch(optim_file)["optimizer"])

    def named_full_params(
        self, bucket_bytes: int = BUCKET_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # Replicated weights: every tensor is already full, nothing to materialise.
        for name, tensor in self.require_module().state_dict().items():
            yield name, tensor.detach()
