"""``FSDPEngine``: the model wrapped in torch's ``FullyShardedDataParallel`` (FSDP1).

Each decoder block is one FSDP unit (``ModuleWrapPolicy`` on the model's block classes) and the
root wraps the rest. ``use_orig_params=True`` keeps the model's own parameter names and lets
frozen and trainable parameters (LoRA) share a unit. State dicts are sharded
(``SHARDED_STATE_DICT``, one DTensor per parameter over the data-parallel mesh): checkpoints and
weight export never gather the whole model on one rank.

On a single rank without mixed precision the engine runs the plain module (there is nothing to
shard, and FSDP1's single-rank fallback, NO_SHARD, is deprecated and drops frozen parameters
from state dicts). FSDP1 keeps flat parameters: a rank's gradient shards are plain tensors, not DTensors, so the
global grad norm and clipping go through ``FullyShardedDataParallel.clip_grad_norm_``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from pydantic import Field, model_validator
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from engine_core.backend import (
    Capability,
    EngineConfig,
    build_model,
)
from engine_core_fsdp._common import (
    FSDPCommonConfig,
    FSDPEngineBase,
    MixedPrecisionConfig,
    decoder_blocks,
    ensure_process_group,
    move_optimizer_state,
)
from engine_core_fsdp._init import build_skeleton
from engine_core_fsdp.capabilities import FSDP_CAPABILITIES

__all__ = ["FSDPEngine", "FSDPEngineConfig"]

SHARDING = {
    "full_shard": ShardingStrategy.FULL_SHARD,
    "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
}


class FSDPEngineConfig(FSDPCommonConfig):
    """FSDP1 settings on top of the common engine fields."""

    sharding_strategy: Literal["full_shard", "shard_grad_op"] = Field(
        "full_shard",
        description=(
            "full_shard: params, grads and optimizer state sharded (ZeRO-3). shard_grad_op: "
            "params stay gathered between forward and backward (ZeRO-2)."
        ),
    )

    @model_validator(mode="after")
    def _fsdp1_limits(self) -> FSDPEngineConfig:
        if self.init == "meta":
            raise ValueError(
                "init='meta' (sharded safetensors loading) is implemented by the fsdp2 engine; "
                "with backend='fsdp' use init='rank0_broadcast' (rank 0 loads, then broadcasts) "
                "or init='all_ranks'."
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                f"backend='fsdp' is data parallel only; got tensor_parallel_size="
                f"{self.tensor_parallel_size}. Use backend='fsdp2' for tensor parallelism."
            )
        return self


def _mixed_precision(cfg: MixedPrecisionConfig | None) -> MixedPrecision | None:
    if cfg is None:
        return None
    # buffers (rotary tables) keep their dtype: only params and gradient reduction change
    return MixedPrecision(param_dtype=cfg.torch_param_dtype, reduce_dtype=cfg.torch_reduce_dtype)


class FSDPEngine(FSDPEngineBase):
    capabilities: ClassVar[frozenset[Capability]] = FSDP_CAPABILITIES
    config_class: ClassVar[type[EngineConfig]] = FSDPEngineConfig
    backend_name: ClassVar[str] = "fsdp"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.wrapped = False

    def init_model(self) -> None:
        ensure_process_group()
        cfg = self.config
        assert isinstance(cfg, FSDPEngineConfig)
        device = self.device
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
        torch.manual_seed(cfg.seed)  # identical initialisation on every rank before sharding
        rank0_only = cfg.init == "rank0_broadcast"
        full_state = None
        if rank0_only:
            # every rank shards a meta skeleton; rank 0's full weights are broadcast afterwards
            # (FSDP's own sync_module_states is GPU-only)
            if dist.get_rank() == 0:
                full_state = build_model(cfg.model, device="cpu").state_dict()
            module = build_skeleton(cfg.model)
        else:
            module = build_model(cfg.model, device=device)
        # One rank without mixed precision: nothing to shard, and FSDP1 would fall back to its
        # deprecated NO_SHARD mode, whose state-dict hooks lose frozen root parameters (LoRA)
        # after a forward. Run the plain module there; the engine's contract is unchanged.
        # Mixed precision (mixed_precision or compute_dtype) needs the wrapper to cast.
        precision = cfg.precision_policy
        self.wrapped = dist.get_world_size() > 1 or precision is not None
        if not self.wrapped:
            if rank0_only:
                module = build_model(cfg.model, device=device)
            self.module = module
            self.init_optimizer(module)
            return
        block_types = {type(b) for b in decoder_blocks(module)}
        wrapped = FSDP(
            module,
            device_mesh=self.mesh,
            device_id=device,
            auto_wrap_policy=ModuleWrapPolicy(block_types) if block_types else None,
            sharding_strategy=SHARDING[cfg.sharding_strategy],
            mixed_precision=_mixed_precision(precision),
            use_orig_params=True,
            param_init_fn=_empty_on(device) if rank0_only else None,
        )
        if rank0_only:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(wrapped, full_state or {}, options=options)
            del full_state
        self.module = wrapped
        self.init_optimizer(wrapped)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        module = self.require_module()
        if not isinstance(module, FSDP):
            return contextlib.nullcontext()  # one rank: no gradient sync to skip
        return module.no_sync()

    def to(self, device: torch.device | str, *, model: bool = True, optimizer: bool = True) -> None:
        target = torch.device(device)
        if target.type == "cpu" and self.device.type == "cpu":
            return  # a CPU-only run has nowhere to offload to: documented no-op
        if model and not self.wrapped:
            self.require_module().to(target)
        elif model:
            # FSDP1 keeps each unit's shard in one flat parameter (and its ``_local_shard``
            # alias); move that, then re-point the original parameters' views at it.
            module = self.require_module()
            for unit in FSDP.fsdp_modules(module):
                handle = unit._handle
                if handle is None:
                    continue
                flat = handle.flat_param
                flat.data = flat.data.to(target, non_blocking=True)
                flat._local_shard = flat.data
                handle._use_sharded_views()
        if optimizer and self.optimizer is not None:
            move_optimizer_state(self.optimizer, target)

    def optimizer_step(self) -> float:
        assert self.optimizer is not None, "call init_model() first"
        module = self.require_module()
        if not isinstance(module, FSDP):
            return super().optimizer_step()
        max_norm = self.config.optim.clip_grad
        # collective over the shards; max_norm=inf measures without scaling
        norm = float(module.clip_grad_norm_(math.inf if max_norm is None else max_norm))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            return norm
        self.optimizer.step()
        return norm


def _empty_on(device: torch.device) -> Any:
    """``param_init_fn`` for a meta skeleton: storage for its parameters, filled later by the
    broadcast; buffers (computed, e.g. rotary tables, and often not in the state dict) kept."""

    def init(module: torch.nn.Module) -> None:
        buffers = {name: b.detach().clone() for name, b in module.named_buffers(recurse=False)}
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            for name, b in module.named_buffers(recurse=False):
                b.copy_(buffers[name])

    return init
