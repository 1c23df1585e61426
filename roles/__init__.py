"""Engine-agnostic RL roles built on engine_core's public API.

RL losses (:mod:`roles.losses`) and advantage estimators (:mod:`roles.advantages`) as pure
functions; the :class:`Actor`, :class:`Critic`, :class:`Reference` and :class:`RewardModel` roles
on any :class:`engine_core.BaseEngine`, in-process or as worker groups (:mod:`roles.workers`).
"""

from __future__ import annotations

from roles.actor import Actor, ActorConfig
from roles.advantages import (
    AdaptiveKLController,
    FixedKLController,
    gae_advantages,
    grpo_advantages,
    rloo_advantages,
    sequence_to_token_rewards,
)
from roles.critic import Critic, CriticConfig
from roles.losses import KLEstimator, entropy_loss, kl_penalty, policy_loss, value_loss
from roles.reference import Reference
from roles.reward_model import RewardModel

__all__ = [
    "Actor",
    "ActorConfig",
    "Critic",
    "CriticConfig",
    "Reference",
    "RewardModel",
    "AdaptiveKLController",
    "FixedKLController",
    "KLEstimator",
    "entropy_loss",
    "gae_advantages",
    "grpo_advantages",
    "kl_penalty",
    "policy_loss",
    "rloo_advantages",
    "sequence_to_token_rewards",
    "value_loss",
]
