"""Where roles run and how weights move: worker groups on local processes or Ray (placement,
workers), and the one path from a policy to a rollout (:class:`WeightLink`).
"""

from __future__ import annotations

from engine_core_roles.distributed.placement import (
    ActorGroup,
    CriticGroup,
    PlacementConfig,
    RayConfig,
    ReferenceGroup,
    RewardModelGroup,
    RoleGroup,
    RolePlacement,
    start_group,
)
from engine_core_roles.distributed.weights import WeightLink
from engine_core_roles.distributed.workers import (
    ActorWorker,
    CriticWorker,
    ReferenceWorker,
    RewardModelWorker,
    build_engine,
)

__all__ = [
    "ActorGroup",
    "CriticGroup",
    "PlacementConfig",
    "RayConfig",
    "ReferenceGroup",
    "RewardModelGroup",
    "RoleGroup",
    "RolePlacement",
    "start_group",
    "WeightLink",
    "ActorWorker",
    "CriticWorker",
    "ReferenceWorker",
    "RewardModelWorker",
    "build_engine",
]
