"""The core's own backends, registered through the same hook as any third-party plugin."""

from __future__ import annotations

from engine_core.capabilities import Capability
from engine_core.hookspecs import hookimpl

__all__ = ["REFERENCE_CAPABILITIES", "engine_core_register"]

# Declared here (cheap to import) and reused by the engine class, so the two cannot drift.
REFERENCE_CAPABILITIES = frozenset(
    {
        Capability.CPU,
        Capability.PACKING,
        Capability.DYNAMIC_BATCH,
        Capability.DATA_PARALLEL,
        Capability.WEIGHT_EXPORT,
        Capability.VALUE_HEAD,
        Capability.GRADIENT_CHECKPOINTING,
    }
)


@hookimpl
def engine_core_register(registry) -> None:  # type: ignore[no-untyped-def]
    registry.register_engine(
        "reference",
        "engine_core.reference_engine:ReferenceEngine",
        config="engine_core.reference_engine:ReferenceEngineConfig",
        capabilities=REFERENCE_CAPABILITIES,
        description="Plain PyTorch, replicated weights, all-reduce DP; for tests and parity.",
    )
