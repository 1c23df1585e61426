"""The core's own backends, registered through the same hook as any third-party plugin."""

from __future__ import annotations

from engine_core._capsets import REFERENCE_CAPABILITIES
from engine_core.hookspecs import hookimpl

__all__ = ["engine_core_register"]


@hookimpl
def engine_core_register(registry) -> None:  # type: ignore[no-untyped-def]
    registry.register_engine(
        "reference",
        "engine_core.reference_engine:ReferenceEngine",
        config="engine_core.reference_engine:ReferenceEngineConfig",
        capabilities=REFERENCE_CAPABILITIES,
        description="Plain PyTorch, replicated weights, all-reduce DP; for tests and parity.",
    )
