"""Engine-agnostic RL roles built on engine_core's public API.

RL losses (:mod:`engine_core_roles.losses`) and advantage estimators (:mod:`engine_core_roles.advantages`) as pure
functions; the :class:`Actor`, :class:`Critic`, :class:`Reference` and :class:`RewardModel` roles
on any :class:`engine_core.BaseEngine`, in-process or as worker groups (:mod:`engine_core_roles.workers`);
the batches passed between a rollout and the roles, and the names of their fields
(:mod:`engine_core_roles.batches`); and :class:`RLTrainer`, the GRPO / PPO loop over all of them
(:mod:`engine_core_roles.trainer`).
"""

from __future__ import annotations

from engine_core_roles.actor import (
    ADVANTAGES,
    OLD_LOG_PROBS,
    REF_LOG_PROBS,
    ROLLOUT_LOG_PROBS,
    Actor,
    ActorConfig,
    ActorUpdate,
)
from engine_core_roles.advantages import (
    AdaptiveKLController,
    FixedKLController,
    gae_advantages,
    grpo_advantages,
    rloo_advantages,
    sequence_to_token_rewards,
)
from engine_core_roles.batches import prompt_batch, training_batch
from engine_core_roles.critic import OLD_VALUES, RETURNS, Critic, CriticConfig
from engine_core_roles.losses import (
    KLEstimator,
    MISLevel,
    MismatchCorrection,
    entropy_loss,
    kl_penalty,
    mis_weights,
    policy_loss,
    tis_weights,
    value_loss,
)
from engine_core_roles.reference import Reference
from engine_core_roles.reward_model import RewardModel
from engine_core_roles.trainer import (
    PromptSource,
    RewardFn,
    RLTrainer,
    StepCallback,
    TrainerConfig,
    plot_keys,
)
from engine_core_roles.weights import WeightLink

__all__ = [
    "WeightLink",
    "Actor",
    "ActorConfig",
    "ActorUpdate",
    "Critic",
    "CriticConfig",
    "Reference",
    "RewardModel",
    "RLTrainer",
    "TrainerConfig",
    "RewardFn",
    "PromptSource",
    "StepCallback",
    "plot_keys",
    "prompt_batch",
    "training_batch",
    "ADVANTAGES",
    "OLD_LOG_PROBS",
    "REF_LOG_PROBS",
    "ROLLOUT_LOG_PROBS",
    "OLD_VALUES",
    "RETURNS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLEstimator",
    "MismatchCorrection",
    "MISLevel",
    "entropy_loss",
    "gae_advantages",
    "grpo_advantages",
    "kl_penalty",
    "mis_weights",
    "policy_loss",
    "rloo_advantages",
    "sequence_to_token_rewards",
    "tis_weights",
    "value_loss",
]
