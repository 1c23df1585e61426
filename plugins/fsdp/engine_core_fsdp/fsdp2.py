"""``FSDP2Engine``: parameters sharded with ``fully_shard`` over the data-parallel ranks.

Each decoder block is sharded on its own, then the root module. Gradients follow the core's
loss contract: losses are already normalized by global counts, so gradients must be summed over
ranks; FSDP averages them, so each micro-batch loss is scaled by the DP size before backward. Checkpoints use
``torch.distributed.checkpoint`` (every rank writes its shards) into the core's atomic
``global_step_<N>`` folders.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import Field
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from engine_core.capabilities import Capability
from engine_core.checkpoint import commit_staging, staging_dir
from engine_core.config import EngineConfig
from engine_core.engine import BaseEngine
from engine_core.errors import CheckpointError
from engine_core.models import build_model
from engine_core.optim import SingleOptimizerMixin
from engine_core_fsdp.capabilities import FSDP2_CAPABILITIES

__all__ = ["FSDP2Engine", "FSDP2EngineConfig"]

STATE_FILE = "engine_state_rank{rank}.pt"


class FSDP2EngineConfig(EngineConfig):
    """FSDP2 settings on top of the common engine fields."""

    reshard_after_forward: bool = Field(
        True, description="Free unsharded params after forward (ZeRO-3)."
    )


def _ensure_process_group() -> None:
    # a one-rank group lets the same code path run in a plain single process
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class FSDP2Engine(SingleOptimizerMixin, BaseEngine):
    capabilities: ClassVar[frozenset[Capability]] = FSDP2_CAPABILITIES
    config_class: ClassVar[type[EngineConfig]] = FSDP2EngineConfig

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.mesh: DeviceMesh | None = None
        self.optimizer = None
        self.scheduler = None
        self.skipped_steps = 0

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group() if self.mesh is not None else None

    def init_model(self) -> None:
        _ensure_process_group()
        cfg = self.config
        assert isinstance(cfg, FSDP2EngineConfig)
        self.mesh = init_device_mesh(
            self.device.type, (dist.get_world_size(),), mesh_dim_names=("dp",)
        )
        torch.manual_seed(cfg.seed)  # identical initialisation on every rank before sharding
        module = build_model(cfg.model, device=self.device)
        for block in _decoder_blocks(module):
            fully_shard(block, mesh=self.mesh, reshard_after_forward=cfg.reshard_after_forward)
        fully_shard(module, mesh=self.mesh, reshard_after_forward=cfg.reshard_after_forward)
        self.module = module
        self.init_optimizer(module)

    def backward(self, loss: torch.Tensor) -> None:
        # The reduce-scatter averages over ranks; the loss contract wants the sum. Scaling the
        # loss (not a custom divide factor, whose PREMUL_SUM op gloo lacks) works on every backend.
        (loss * self.dp_size).backward()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        module = self._require_module()
        assert isinstance(module, FSDPModule)
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self._no_sync()

    def to(self, device: torch.device | str, *, model: bool = True, optimizer: bool = True) -> None:
        # CPU-only hosts have nowhere to offload to: moving to CPU is a no-op here.
        if torch.device(device).type != "cpu" or self.device.type != "cpu":
            raise NotImplementedError(
                "FSDP2 offload is only implemented for CPU-resident runs so far."
            )

    def named_full_params(
        self, bucket_bytes: int = 512 << 20
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # one parameter at a time: never the whole unsharded model (every rank must iterate)
        for name, tensor in self._require_module().state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            yield name, full.detach()

    def save_checkpoint(self, path: str, *, step: int, max_ckpt_to_keep: int | None = None) -> str:
        assert self.optimizer is not None
        rank = dist.get_rank()
        if rank == 0:
            staging_dir(path, step)
        dist.barrier()
        folder = Path(path) / f"global_step_{step}.tmp"
        model_sd, optim_sd = get_state_dict(self._require_module(), self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "dcp"))
        torch.save(
            {"step": step, **self.optimizer_extra_state()},
            folder / STATE_FILE.format(rank=rank),
        )
        dist.barrier()
        if rank == 0:
            commit_staging(path, step, max_ckpt_to_keep)
        dist.barrier()
        return str(Path(path) / f"global_step_{step}")

    def load_checkpoint(self, path: str) -> int:
        assert self.optimizer is not None
        folder = Path(path)
        state_file = folder / STATE_FILE.format(rank=dist.get_rank())
        if not (folder / "dcp").is_dir() or not state_file.is_file():
            raise CheckpointError(
                f"{folder} is not a complete fsdp2 checkpoint (need dcp/ and {state_file.name}); "
                f"pass a global_step_<N> folder written by save_checkpoint() with the same DP size."
            )
        module = self._require_module()
        model_sd, optim_sd = get_state_dict(module, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(folder / "dcp"))
        set_state_dict(
            module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        extra = torch.load(state_file, weights_only=False)
        self.load_optimizer_extra_state(extra)
        return int(extra["step"])


def _decoder_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (transformers names them in ``_no_split_modules``)."""
    names = set(getattr(module, "_no_split_modules", None) or [])
    return [m for m in module.modules() if type(m).__name__ in names]
