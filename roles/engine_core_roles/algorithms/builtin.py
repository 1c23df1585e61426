"""The shipped advantage estimators and policy losses, each a plugin class like a user's own.

They are registered by :mod:`engine_core_roles.algorithms.plugin` (the ``algorithms`` entry
point of ``engine-core-roles``). The maths are the pure functions of
:mod:`~engine_core_roles.algorithms.advantages` and :mod:`~engine_core_roles.algorithms.losses`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pydantic import Field

from engine_core import FrozenModel
from engine_core_roles.algorithms.advantages import (
    gae_advantages,
    group_mean_term,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    signal_groups,
    stalled_groups,
    whiten,
)
from engine_core_roles.algorithms.base import (
    AdvantageEstimator,
    AdvantageInputs,
    AdvantageResult,
    PolicyLoss,
    PolicyLossInputs,
)
from engine_core_roles.algorithms.losses import cispo_loss, gspo_loss, policy_loss

__all__ = [
    "GAE",
    "GRPO",
    "GRPOParams",
    "RLOO",
    "ReinforcePP",
    "ReinforcePPBaseline",
    "PPOClip",
    "PPOClipParams",
    "GSPO",
    "GSPOParams",
    "CISPO",
    "CISPOParams",
]


def _with_inputs(
    loss: Callable[..., dict[str, torch.Tensor]], inputs: PolicyLossInputs, **clip: Any
) -> dict[str, torch.Tensor]:
    """``loss`` (one of :mod:`~engine_core_roles.algorithms.losses`) on a micro-batch's inputs,
    its aggregation and mismatch weights, with the loss's own clip settings."""
    return loss(
        inputs.log_probs,
        inputs.old_log_probs,
        inputs.advantages,
        inputs.mask,
        inputs.ctx,
        aggregation=inputs.aggregation,
        norm_length=inputs.norm_length,
        weights=inputs.weights,
        **clip,
    )


def _per_token(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_sample.unsqueeze(1) * mask.to(per_sample.dtype)


class GAE(AdvantageEstimator):
    """PPO's: generalized advantage estimation over the critic's values (``trainer.gamma``,
    ``trainer.lam``), whitened over the batch; the returns train the critic."""

    def __call__(self, inputs: AdvantageInputs) -> AdvantageResult:
        if inputs.values is None:
            raise ValueError("gae needs the critic's values; the run must have a critic.")
        adv, returns = gae_advantages(
            inputs.per_token_rewards(),
            inputs.values,
            inputs.mask,
            gamma=inputs.gamma,
            lam=inputs.lam,
        )
        return AdvantageResult(whiten(adv, inputs.mask), returns)


class GRPOParams(FrozenModel):
    """GRPO's parameters."""

    normalize_std: bool = Field(
        True,
        description="Divide each group's centered scores by the group's std. false: Dr. GRPO's "
        "unbiased form (centered scores only; pair it with loss_agg_mode "
        "seq-mean-token-sum-norm, as the dr_grpo preset does).",
    )
    eps: float = Field(1e-6, gt=0, description="Added to the group's std before dividing.")
    group_mean_weight: float = Field(
        0.0,
        ge=0,
        description="Adds this times (group mean - batch mean) / batch std to each sample's "
        "advantage: a group whose samples all scored the same, below the batch, is still pushed "
        "away from its answer (group normalization alone gives it 0). 0: plain GRPO.",
    )
    signal_scale: bool = Field(
        False,
        description="Multiply every advantage by the batch's sample count over the count of "
        "samples in groups with two different scores, so the loss's token mean is as if taken "
        "over the groups that carry signal alone: the update keeps its size as groups turn "
        "uniform (all right, or all equally wrong), without drawing more prompts as "
        "trainer.filter_groups does.",
    )
    stalled_unlikelihood: float = Field(
        0.0,
        ge=0,
        description="Weight of an unlikelihood term, -log(1 - p) of each sampled token, on the "
        "samples of stalled groups: groups whose samples all scored the same, below the batch's "
        "best. Group normalization gives them 0, and once the policy is sure of its answer a "
        "policy gradient away from it vanishes with 1 - p; this term's does not, so the policy "
        "leaves an answer it gives every time and the group differs again. It acts on no other "
        "group. 0: off.",
    )


class GRPO(AdvantageEstimator):
    """Each score minus its group's mean (divided by the group's std unless
    ``normalize_std=false``), on every loss token; a group of equal scores gets 0."""

    params: GRPOParams

    def __call__(self, inputs: AdvantageInputs) -> AdvantageResult:
        rewards = inputs.sequence_rewards()
        adv = grpo_advantages(
            rewards,
            inputs.group_ids,
            normalize_std=self.params.normalize_std,
            eps=self.params.eps,
        )
        if self.params.group_mean_weight:
            adv = adv + self.params.group_mean_weight * group_mean_term(
                rewards, inputs.group_ids, eps=self.params.eps
            )
        if self.params.signal_scale:
            signal = signal_groups(rewards, inputs.group_ids)
            adv = adv * (signal.numel() / max(1, int(signal.sum())))
        if not self.params.stalled_unlikelihood:
            return AdvantageResult(_per_token(adv, inputs.mask))
        stalled = stalled_groups(rewards, inputs.group_ids).float()
        return AdvantageResult(
            _per_token(adv, inputs.mask),
            metrics={"stalled_frac": float(stalled.mean()) if stalled.numel() else 0.0},
            unlikelihood_weights=_per_token(
                self.params.stalled_unlikelihood * stalled, inputs.mask
            ),
        )


class RLOO(AdvantageEstimator):
    """Each score minus the mean of the other samples of its group, on every loss token."""

    def __call__(self, inputs: AdvantageInputs) -> AdvantageResult:
        return AdvantageResult(
            _per_token(rloo_advantages(inputs.sequence_rewards(), inputs.group_ids), inputs.mask)
        )


class ReinforcePP(AdvantageEstimator):
    """REINFORCE++: each token's discounted return (``trainer.gamma``), whitened over the batch;
    no critic, no groups."""

    def __call__(self, inputs: AdvantageInputs) -> AdvantageResult:
        return AdvantageResult(
            reinforce_pp_advantages(
                inputs.scores, inputs.mask, gamma=inputs.gamma, token_rewards=inputs.token_rewards
            )
        )


class ReinforcePPBaseline(AdvantageEstimator):
    """REINFORCE++-baseline: each score minus its group's mean, whitened over the batch."""

    def __call__(self, inputs: AdvantageInputs) -> AdvantageResult:
        return AdvantageResult(
            reinforce_pp_baseline_advantages(
                inputs.sequence_rewards(), inputs.group_ids, inputs.mask
            )
        )


class PPOClipParams(FrozenModel):
    """PPO's clip range on the token ratio, ``[1 - clip_ratio_low, 1 + clip_ratio_high]``, and
    the dual-clip bound on negative advantages. The upper end is wider than the lower (0.28 over
    0.2: the clip-higher of DAPO), which keeps rare tokens' probabilities able to rise."""

    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.28, ge=0)
    clip_ratio_c: float | None = Field(3.0, gt=1, description="Dual-clip bound; None disables it.")


class PPOClip(PolicyLoss):
    """PPO's clipped surrogate with dual clip (``policy_loss_params``: :class:`PPOClipParams`)."""

    params: PPOClipParams

    def __call__(self, inputs: PolicyLossInputs) -> dict[str, torch.Tensor]:
        return _with_inputs(
            policy_loss,
            inputs,
            clip_ratio_low=self.params.clip_ratio_low,
            clip_ratio_high=self.params.clip_ratio_high,
            clip_ratio_c=self.params.clip_ratio_c,
        )


class GSPOParams(FrozenModel):
    """GSPO's clip range, on the sequence's ratio (far narrower than PPO's token ratio)."""

    clip_ratio_low: float = Field(3e-4, ge=0, lt=1)
    clip_ratio_high: float = Field(4e-4, ge=0)


class GSPO(PolicyLoss):
    """Sequence-level importance ratio (the geometric mean of its tokens'), clipped per sequence."""

    params: GSPOParams

    def __call__(self, inputs: PolicyLossInputs) -> dict[str, torch.Tensor]:
        return _with_inputs(
            gspo_loss,
            inputs,
            clip_ratio_low=self.params.clip_ratio_low,
            clip_ratio_high=self.params.clip_ratio_high,
        )


class CISPOParams(FrozenModel):
    """CISPO's bounds on the importance weight: ``[1 - clip_ratio_low, 1 + clip_ratio_high]``."""

    clip_ratio_low: float = Field(
        1.0, ge=0, le=1, description="1: no lower bound on the weight (the paper's choice)."
    )
    clip_ratio_high: float = Field(0.28, ge=0)


class CISPO(PolicyLoss):
    """Clipped, detached importance weights times the advantage times the log-prob."""

    params: CISPOParams

    def __call__(self, inputs: PolicyLossInputs) -> dict[str, torch.Tensor]:
        return _with_inputs(
            cispo_loss,
            inputs,
            clip_ratio_low=self.params.clip_ratio_low,
            clip_ratio_high=self.params.clip_ratio_high,
        )
