"""Registers the ``sglang`` rollout. Cheap to import: names and strings only (no sglang import)."""

from __future__ import annotations

from engine_core.backend import (
    BackendRegistry,
    Capability,
    hookimpl,
)

__all__ = ["engine_core_register", "SGLANG_CAPABILITIES"]

# No CPU: SGLang runs on CUDA GPUs only. SLEEP: release()/resume() free and re-allocate GPU
# memory through SGLang's memory saver.
SGLANG_CAPABILITIES = frozenset({Capability.LOGPROBS, Capability.SLEEP})


@hookimpl
def engine_core_register(registry: BackendRegistry) -> None:
    registry.register_rollout(
        "sglang",
        "engine_core_sglang.rollout:SGLangRollout",
        config="engine_core_sglang.rollout:SGLangRolloutConfig",
        capabilities=SGLANG_CAPABILITIES,
        description="SGLang offline engine (CUDA GPUs only), verified bucketed weight updates.",
    )
