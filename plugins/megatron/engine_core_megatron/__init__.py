"""engine-core's megatron-core training engine (backend ``megatron``)."""

from __future__ import annotations

__all__ = ["MegatronEngine", "MegatronEngineConfig"]


def __getattr__(name: str) -> object:
    # megatron-core is imported only when the engine is used, not when plugins are listed
    if name == "MegatronEngine":
        from engine_core_megatron.engine import MegatronEngine

        return MegatronEngine
    if name == "MegatronEngineConfig":
        from engine_core_megatron.config import MegatronEngineConfig

        return MegatronEngineConfig
    raise AttributeError(name)
