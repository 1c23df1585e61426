"""The maths of RL and SFT updates, engine-agnostic: losses and advantage estimators as pure
functions and as plugin classes (:mod:`~engine_core_roles.algorithms.base`, the shipped ones in
:mod:`~engine_core_roles.algorithms.builtin`, chosen by :mod:`~engine_core_roles.algorithms.select`),
the update loop every trainable role shares, and the supervised step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core._lazy import lazy_exports

# public name -> module defining it: imported on first use, so that importing a submodule
# (a plugin's hook module, say) does not import torch
_EXPORTS: dict[str, str] = {
    "gae_advantages": "engine_core_roles.algorithms.advantages",
    "grpo_advantages": "engine_core_roles.algorithms.advantages",
    "rloo_advantages": "engine_core_roles.algorithms.advantages",
    "sequence_to_token_rewards": "engine_core_roles.algorithms.advantages",
    "FixedKLController": "engine_core_roles.algorithms.advantages",
    "AdaptiveKLController": "engine_core_roles.algorithms.advantages",
    "KLEstimator": "engine_core_roles.algorithms.losses",
    "kl_penalty": "engine_core_roles.algorithms.losses",
    "MismatchCorrection": "engine_core_roles.algorithms.losses",
    "MISLevel": "engine_core_roles.algorithms.losses",
    "CorrectionWeights": "engine_core_roles.algorithms.losses",
    "tis_weights": "engine_core_roles.algorithms.losses",
    "mis_weights": "engine_core_roles.algorithms.losses",
    "policy_loss": "engine_core_roles.algorithms.losses",
    "value_loss": "engine_core_roles.algorithms.losses",
    "entropy_loss": "engine_core_roles.algorithms.losses",
    "PolicyLossTerms": "engine_core_roles.algorithms.losses",
    "sft_loss": "engine_core_roles.algorithms.supervised",
    "supervised_step": "engine_core_roles.algorithms.supervised",
    "run_updates": "engine_core_roles.algorithms.updates",
    "local_mini_batch_size": "engine_core_roles.algorithms.updates",
    "mean_over_steps": "engine_core_roles.algorithms.updates",
    "non_finite_inputs": "engine_core_roles.algorithms.updates",
    "warn_skipped": "engine_core_roles.algorithms.updates",
    "discounted_returns": "engine_core_roles.algorithms.advantages",
    "reinforce_pp_advantages": "engine_core_roles.algorithms.advantages",
    "reinforce_pp_baseline_advantages": "engine_core_roles.algorithms.advantages",
    "group_mean_term": "engine_core_roles.algorithms.advantages",
    "whiten": "engine_core_roles.algorithms.advantages",
    "gspo_loss": "engine_core_roles.algorithms.losses",
    "cispo_loss": "engine_core_roles.algorithms.losses",
    "AdvantageEstimator": "engine_core_roles.algorithms.base",
    "AdvantageInputs": "engine_core_roles.algorithms.base",
    "AdvantageResult": "engine_core_roles.algorithms.base",
    "PolicyLoss": "engine_core_roles.algorithms.base",
    "PolicyLossInputs": "engine_core_roles.algorithms.base",
    "NoParams": "engine_core_roles.algorithms.base",
    "AlgorithmConfig": "engine_core_roles.algorithms.select",
    "OverlongShaping": "engine_core_roles.algorithms.select",
    "PRESETS": "engine_core_roles.algorithms.select",
    "resolve_algorithm": "engine_core_roles.algorithms.select",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from engine_core_roles.algorithms.advantages import (
        AdaptiveKLController,
        FixedKLController,
        discounted_returns,
        gae_advantages,
        group_mean_term,
        grpo_advantages,
        reinforce_pp_advantages,
        reinforce_pp_baseline_advantages,
        rloo_advantages,
        sequence_to_token_rewards,
        whiten,
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
        CorrectionWeights,
        KLEstimator,
        MISLevel,
        MismatchCorrection,
        PolicyLossTerms,
        cispo_loss,
        entropy_loss,
        gspo_loss,
        kl_penalty,
        mis_weights,
        policy_loss,
        tis_weights,
        value_loss,
    )
    from engine_core_roles.algorithms.select import (
        PRESETS,
        AlgorithmConfig,
        OverlongShaping,
        resolve_algorithm,
    )
    from engine_core_roles.algorithms.supervised import sft_loss, supervised_step
    from engine_core_roles.algorithms.updates import (
        local_mini_batch_size,
        mean_over_steps,
        non_finite_inputs,
        run_updates,
        warn_skipped,
    )


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
