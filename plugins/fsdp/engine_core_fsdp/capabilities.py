"""Capability sets, declared once for the registry and the engine classes."""

from __future__ import annotations

from engine_core.capabilities import Capability

__all__ = ["FSDP2_CAPABILITIES"]

FSDP2_CAPABILITIES = frozenset(
    {
        Capability.CPU,
        Capability.DATA_PARALLEL,
        Capability.PACKING,
        Capability.DYNAMIC_BATCH,
        Capability.VALUE_HEAD,
        Capability.WEIGHT_EXPORT,
        Capability.GRADIENT_CHECKPOINTING,
    }
)
