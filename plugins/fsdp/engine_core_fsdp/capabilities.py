"""Capability sets, declared once for the registry and the engine classes."""

from __future__ import annotations

from engine_core.backend import (
    Capability,
)

__all__ = ["FSDP_CAPABILITIES", "FSDP2_CAPABILITIES"]

# What both FSDP engines do. Offload is declared: it moves state to the CPU and back on GPU
# hosts and is a documented no-op on CPU-only hosts, where there is nowhere to offload to.
FSDP_CAPABILITIES = frozenset(
    {
        Capability.CPU,
        Capability.DATA_PARALLEL,
        Capability.PACKING,
        Capability.DYNAMIC_BATCH,
        Capability.VALUE_HEAD,
        Capability.WEIGHT_EXPORT,
        Capability.GRADIENT_CHECKPOINTING,
        Capability.BF16,
        Capability.MIXED_PRECISION,  # compute_dtype, through the engines' mixed precision
        Capability.ACTIVATION_OFFLOAD,
        Capability.LORA,
        Capability.OFFLOAD,
        Capability.ROUTING_REPLAY,  # the default forward: transformers' routers, replayed
        Capability.VISION,  # engine_core.vision: images reach the default forward
    }
)

FSDP2_CAPABILITIES = FSDP_CAPABILITIES | {
    Capability.TENSOR_PARALLEL,
    Capability.CONTEXT_PARALLEL,
}
