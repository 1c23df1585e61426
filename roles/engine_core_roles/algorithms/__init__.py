"""The maths of RL and SFT updates, engine-agnostic: losses and advantage estimators as pure
functions, the update loop every trainable role shares, and the supervised step.
"""

from __future__ import annotations

from engine_core_roles.algorithms.advantages import (
    AdaptiveKLController,
    FixedKLController,
    gae_advantages,
    grpo_advantages,
    rloo_advantages,
    sequence_to_token_rewards,
)
from engine_core_roles.algorithms.losses import (
    CorrectionWeights,
    KLEstimator,
    MISLevel,
    MismatchCorrection,
    PolicyLossTerms,
    entropy_loss,
    kl_penalty,
    mis_weights,
    policy_loss,
    tis_weights,
    value_loss,
)
from engine_core_roles.algorithms.supervised import sft_loss, supervised_step
from engine_core_roles.algorithms.updates import (
    local_mini_batch_size,
    mean_over_steps,
    non_finite_inputs,
    run_updates,
    warn_skipped,
)

__all__ = [
    "gae_advantages",
    "grpo_advantages",
    "rloo_advantages",
    "sequence_to_token_rewards",
    "FixedKLController",
    "AdaptiveKLController",
    "KLEstimator",
    "kl_penalty",
    "MismatchCorrection",
    "MISLevel",
    "CorrectionWeights",
    "tis_weights",
    "mis_weights",
    "policy_loss",
    "value_loss",
    "entropy_loss",
    "PolicyLossTerms",
    "sft_loss",
    "supervised_step",
    "run_updates",
    "local_mini_batch_size",
    "mean_over_steps",
    "non_finite_inputs",
    "warn_skipped",
]
