"""Engine-agnostic RL roles built on engine_core's public API.

So far: RL losses (:mod:`roles.losses`) and advantage estimators (:mod:`roles.advantages`) as
pure functions. The Actor / Critic / Reference / RewardModel classes come next.
"""

from __future__ import annotations

from roles.advantages import (
    AdaptiveKLController,
    FixedKLController,
    gae_advantages,
    grpo_advantages,
    rloo_advantages,
    sequence_to_token_rewards,
)
from roles.losses import KLEstimator, entropy_loss, kl_penalty, policy_loss, value_loss

__all__ = [
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
