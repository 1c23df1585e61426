"""Capability sets of the built-in backends; cheap to import, shared by registration and classes."""

from __future__ import annotations

from engine_core.capabilities import Capability

__all__ = ["REFERENCE_CAPABILITIES"]

# One declaration for the registry and the engine class, so the two cannot drift.
REFERENCE_CAPABILITIES = frozenset(
    {
        Capability.CPU,
        Capability.PACKING,
        Capability.DYNAMIC_BATCH,
        Capability.DATA_PARALLEL,
        Capability.WEIGHT_EXPORT,
        Capability.VALUE_HEAD,
        Capability.GRADIENT_CHECKPOINTING,
        Capability.BF16,
        Capability.MIXED_PRECISION,
        Capability.ACTIVATION_OFFLOAD,
        Capability.ROUTING_REPLAY,
        Capability.VISION,  # engine_core.vision: images reach the default forward
    }
)
