"""Engine-agnostic RL roles built on engine_core's public API.

RL losses (:mod:`roles.losses`) and advantage estimators (:mod:`roles.advantages`) as pure
functions; the :class:`Actor` and :class:`Critic` roles on any :class:`engine_core.BaseEngine`.
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

__all__ = [
    "Actor",
    "ActorConfig",
    "Critic",
    "CriticConfig",
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
