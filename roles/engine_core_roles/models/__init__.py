"""The roles on any :class:`engine_core.BaseEngine`: :class:`Actor`, :class:`Critic`,
:class:`Reference` and :class:`RewardModel`.
"""

from __future__ import annotations

from engine_core_roles.models.actor import Actor, ActorConfig, ActorUpdate
from engine_core_roles.models.critic import Critic, CriticConfig
from engine_core_roles.models.reference import Reference
from engine_core_roles.models.reward_model import RewardModel, last_token_index

__all__ = [
    "ActorConfig",
    "Actor",
    "ActorUpdate",
    "CriticConfig",
    "Critic",
    "Reference",
    "RewardModel",
    "last_token_index",
]
