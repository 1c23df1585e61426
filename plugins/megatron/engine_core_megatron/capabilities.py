"""The megatron engine's capability set, declared once for the registry and the engine class."""

from __future__ import annotations

from engine_core.backend import (
    Capability,
)

__all__ = ["MEGATRON_CAPABILITIES"]

# Not declared: LoRA, offload (no CPU-side offload path is implemented), and context
# parallelism (megatron-core's context parallel attention needs TransformerEngine kernels).
MEGATRON_CAPABILITIES = frozenset(
    {
        Capability.CPU,
        Capability.DATA_PARALLEL,
        Capability.TENSOR_PARALLEL,
        Capability.PIPELINE_PARALLEL,
        Capability.PACKING,
        Capability.DYNAMIC_BATCH,
        Capability.VALUE_HEAD,
        Capability.WEIGHT_EXPORT,
        Capability.GRADIENT_CHECKPOINTING,
        Capability.BF16,
        # mixtures of experts: replayed routes, the routers' own choice, their balance terms
        Capability.ROUTING_REPLAY,
    }
)
