"""The transformers ``generate`` rollout for engine-core."""

from __future__ import annotations

__all__ = ["HF_CAPABILITIES"]

from engine_core_hf.capabilities import HF_CAPABILITIES
