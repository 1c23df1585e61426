"""Registers the FSDP engines. Cheap to import: names and strings only."""

from __future__ import annotations

from engine_core.backend import (
    BackendRegistry,
    hookimpl,
)
from engine_core_fsdp.capabilities import FSDP2_CAPABILITIES, FSDP_CAPABILITIES

__all__ = ["engine_core_register"]


@hookimpl
def engine_core_register(registry: BackendRegistry) -> None:
    registry.register_engine(
        "fsdp",
        "engine_core_fsdp.fsdp1:FSDPEngine",
        config="engine_core_fsdp.fsdp1:FSDPEngineConfig",
        capabilities=FSDP_CAPABILITIES,
        description=(
            "torch FullyShardedDataParallel (FSDP1): full_shard / shard_grad_op data "
            "parallel, mixed precision, LoRA, rank-0 broadcast init; DCP checkpoints."
        ),
    )
    registry.register_engine(
        "fsdp2",
        "engine_core_fsdp.fsdp2:FSDP2Engine",
        config="engine_core_fsdp.fsdp2:FSDP2EngineConfig",
        capabilities=FSDP2_CAPABILITIES,
        description=(
            "torch fully_shard (FSDP2): sharded or hybrid-sharded (HSDP) data parallel, optional "
            "tensor or context (Ulysses) parallel, mixed precision, LoRA, meta-device init; DCP "
            "checkpoints."
        ),
    )
