"""FSDP training engines for engine-core: ``fsdp`` (``FullyShardedDataParallel``) and ``fsdp2``
(``torch.distributed.fsdp.fully_shard``)."""

from __future__ import annotations

from engine_core_fsdp.capabilities import FSDP2_CAPABILITIES, FSDP_CAPABILITIES

__all__ = ["FSDP_CAPABILITIES", "FSDP2_CAPABILITIES"]
