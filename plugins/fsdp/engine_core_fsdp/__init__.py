"""FSDP training engines for engine-core (``fsdp2``: ``torch.distributed.fsdp.fully_shard``)."""

from __future__ import annotations

from engine_core_fsdp.capabilities import FSDP2_CAPABILITIES

__all__ = ["FSDP2_CAPABILITIES"]
