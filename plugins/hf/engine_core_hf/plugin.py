"""Registers the ``hf`` rollout. Cheap to import: names and strings only."""

from __future__ import annotations

from engine_core.backend import (
    BackendRegistry,
    hookimpl,
)
from engine_core_hf.capabilities import HF_CAPABILITIES

__all__ = ["engine_core_register"]


@hookimpl
def engine_core_register(registry: BackendRegistry) -> None:
    registry.register_rollout(
        "hf",
        "engine_core_hf.rollout:HFRollout",
        config="engine_core_hf.rollout:HFRolloutConfig",
        capabilities=HF_CAPABILITIES,
        description="transformers generate with KV cache, batched; the embedded default rollout.",
    )
