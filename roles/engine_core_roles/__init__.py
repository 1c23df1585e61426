"""Engine-agnostic RL roles built on engine_core's public API.

RL losses (:mod:`engine_core_roles.algorithms.losses`) and advantage estimators (:mod:`engine_core_roles.algorithms.advantages`) as pure
functions; the :class:`Actor`, :class:`Critic`, :class:`Reference` and :class:`RewardModel` roles
on any :class:`engine_core.BaseEngine`, in-process or as worker groups (:mod:`engine_core_roles.distributed.workers`);
the batches passed between a rollout and the roles, and the names of their fields
(:mod:`engine_core_roles.batch.build`); and :class:`RLTrainer`, the GRPO / PPO loop over all of them
(:mod:`engine_core_roles.trainer`).
"""

from __future__ import annotations

from engine_core.rollout import ROLLOUT_LOG_PROBS
from engine_core_roles.algorithms.advantages import (
    AdaptiveKLController,
    FixedKLController,
    gae_advantages,
    grpo_advantages,
    rloo_advantages,
    sequence_to_token_rewards,
)
from engine_core_roles.algorithms.losses import (
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
from engine_core_roles.batch.build import prompt_batch, training_batch
from engine_core_roles.batch.keys import (
    ADVANTAGES,
    OLD_LOG_PROBS,
    OLD_VALUES,
    REF_LOG_PROBS,
    RETURNS,
)
from engine_core_roles.data.rewards import RewardFn
from engine_core_roles.distributed.weights import WeightLink
from engine_core_roles.roles.actor import Actor, ActorConfig, ActorUpdate
from engine_core_roles.roles.critic import Critic, CriticConfig
from engine_core_roles.roles.reference import Reference
from engine_core_roles.roles.reward_model import RewardModel
from engine_core_roles.trainer.config import TrainerConfig
from engine_core_roles.trainer.loop import RLTrainer, StepCallback
from engine_core_roles.trainer.metrics import plot_keys
from engine_core_roles.trainer.protocols import PromptSource

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
