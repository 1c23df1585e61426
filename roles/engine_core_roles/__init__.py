"""Engine-agnostic RL roles built on engine_core's public API.

RL losses (:mod:`engine_core_roles.algorithms.losses`) and advantage estimators (:mod:`engine_core_roles.algorithms.advantages`) as pure
functions, and as plugin classes (:class:`AdvantageEstimator`, :class:`PolicyLoss`) chosen by
``TrainerConfig.algorithm``; the :class:`Actor`, :class:`Critic`, :class:`Reference` and :class:`RewardModel` roles
on any :class:`engine_core.BaseEngine`, in-process or as worker groups (:mod:`engine_core_roles.distributed.workers`);
the batches passed between a rollout and the roles, and the names of their fields
(:mod:`engine_core_roles.batch.build`); and :class:`RLTrainer`, the RL loop (GRPO, PPO or any registered algorithm) over all of them
(:mod:`engine_core_roles.trainer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core._lazy import lazy_exports

# public name -> module defining it: imported on first use, so that importing a submodule
# (a plugin's hook module, say) does not import torch
_EXPORTS: dict[str, str] = {
    "WeightLink": "engine_core_roles.distributed.weights",
    "Actor": "engine_core_roles.models.actor",
    "ActorConfig": "engine_core_roles.models.actor",
    "ActorUpdate": "engine_core_roles.models.actor",
    "Critic": "engine_core_roles.models.critic",
    "CriticConfig": "engine_core_roles.models.critic",
    "Reference": "engine_core_roles.models.reference",
    "RewardModel": "engine_core_roles.models.reward_model",
    "RLTrainer": "engine_core_roles.trainer.loop",
    "TrainerConfig": "engine_core_roles.trainer.config",
    "AlgorithmConfig": "engine_core_roles.algorithms.select",
    "OverlongShaping": "engine_core_roles.algorithms.select",
    "PRESETS": "engine_core_roles.algorithms.select",
    "AdvantageEstimator": "engine_core_roles.algorithms.base",
    "AdvantageInputs": "engine_core_roles.algorithms.base",
    "AdvantageResult": "engine_core_roles.algorithms.base",
    "PolicyLoss": "engine_core_roles.algorithms.base",
    "PolicyLossInputs": "engine_core_roles.algorithms.base",
    "NoParams": "engine_core_roles.algorithms.base",
    "RewardFn": "engine_core_roles.data.rewards.functions",
    "PromptSource": "engine_core_roles.trainer.protocols",
    "StepCallback": "engine_core_roles.trainer.loop",
    "plot_keys": "engine_core_roles.trainer.metrics",
    "prompt_batch": "engine_core_roles.batch.build",
    "training_batch": "engine_core_roles.batch.build",
    "ADVANTAGES": "engine_core_roles.batch.keys",
    "OLD_LOG_PROBS": "engine_core_roles.batch.keys",
    "REF_LOG_PROBS": "engine_core_roles.batch.keys",
    "ROLLOUT_LOG_PROBS": "engine_core.rollout",
    "OLD_VALUES": "engine_core_roles.batch.keys",
    "RETURNS": "engine_core_roles.batch.keys",
    "AdaptiveKLController": "engine_core_roles.algorithms.advantages",
    "FixedKLController": "engine_core_roles.algorithms.advantages",
    "KLEstimator": "engine_core_roles.algorithms.losses",
    "MismatchCorrection": "engine_core_roles.algorithms.losses",
    "MISLevel": "engine_core_roles.algorithms.losses",
    "entropy_loss": "engine_core_roles.algorithms.losses",
    "gae_advantages": "engine_core_roles.algorithms.advantages",
    "grpo_advantages": "engine_core_roles.algorithms.advantages",
    "kl_penalty": "engine_core_roles.algorithms.losses",
    "mis_weights": "engine_core_roles.algorithms.losses",
    "policy_loss": "engine_core_roles.algorithms.losses",
    "rloo_advantages": "engine_core_roles.algorithms.advantages",
    "sequence_to_token_rewards": "engine_core_roles.algorithms.advantages",
    "tis_weights": "engine_core_roles.algorithms.losses",
    "value_loss": "engine_core_roles.algorithms.losses",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from engine_core.rollout import ROLLOUT_LOG_PROBS
    from engine_core_roles.algorithms.advantages import (
        AdaptiveKLController,
        FixedKLController,
        gae_advantages,
        grpo_advantages,
        rloo_advantages,
        sequence_to_token_rewards,
    )
    from engine_core_roles.algorithms.base import (
        AdvantageEstimator,
        AdvantageInputs,
        AdvantageResult,
        NoParams,
        PolicyLoss,
        PolicyLossInputs,
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
    from engine_core_roles.algorithms.select import PRESETS, AlgorithmConfig, OverlongShaping
    from engine_core_roles.batch.build import prompt_batch, training_batch
    from engine_core_roles.batch.keys import (
        ADVANTAGES,
        OLD_LOG_PROBS,
        OLD_VALUES,
        REF_LOG_PROBS,
        RETURNS,
    )
    from engine_core_roles.data.rewards.functions import RewardFn
    from engine_core_roles.distributed.weights import WeightLink
    from engine_core_roles.models.actor import Actor, ActorConfig, ActorUpdate
    from engine_core_roles.models.critic import Critic, CriticConfig
    from engine_core_roles.models.reference import Reference
    from engine_core_roles.models.reward_model import RewardModel
    from engine_core_roles.trainer.config import TrainerConfig
    from engine_core_roles.trainer.loop import RLTrainer, StepCallback
    from engine_core_roles.trainer.metrics import plot_keys
    from engine_core_roles.trainer.protocols import PromptSource


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
