"""Registers the megatron engine. Cheap to import: names and strings only."""

from __future__ import annotations

from engine_core.backend import (
    BackendRegistry,
    hookimpl,
)
from engine_core_megatron.capabilities import MEGATRON_CAPABILITIES

__all__ = ["engine_core_register"]


@hookimpl
def engine_core_register(registry: BackendRegistry) -> None:
    registry.register_engine(
        "megatron",
        "engine_core_megatron.engine:MegatronEngine",
        config="engine_core_megatron.config:MegatronEngineConfig",
        capabilities=MEGATRON_CAPABILITIES,
        imports=("megatron.core",),  # imported by the engine only as it builds: seconds
        description=(
            "megatron-core GPTModel (Llama/Qwen2/Qwen3 families): tensor, sequence, pipeline (1F1B, "
            "interleaved) and data parallel, distributed optimizer, vocabulary-parallel "
            "log-probs; dist_checkpointing checkpoints with resharding on load."
        ),
    )
