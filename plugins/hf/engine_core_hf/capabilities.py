"""The HF rollout's capability set: one declaration for the registry and the class."""

from __future__ import annotations

from engine_core.backend import (
    Capability,
)

__all__ = ["HF_CAPABILITIES"]

HF_CAPABILITIES = frozenset({Capability.CPU, Capability.LOGPROBS, Capability.SLEEP})
