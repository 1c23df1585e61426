"""RL losses as pure functions on per-token tensors, normalized by the global-batch context.

Every loss returns this micro-batch's share of the mini-batch loss (see
:mod:`engine_core.loss`): summed over micro-batches and DP ranks it is the mini-batch mean, so
gradients and logged values do not depend on how the batch was split.
"""

from __future__ import annotations

import torch

from engine_core import GlobalBatchContext, LossAggregation, aggregate_loss
from engine_core.capabilities import StrEnum

__all__ = [
    "KLEstimator",
    "kl_penalty",
    "policy_loss",
    "value_loss",
    "entropy_loss",
    "PolicyLossTerms",
]


class KLEstimator(StrEnum):
    """Per-token estimators of KL(policy || reference) from log-probs of sampled tokens.

    ``k1``: ``log p - log q``; ``k2``: ``0.5 (log p - log q)^2``; ``k3`` (low variance,
    non-negative): ``exp(log q - log p) - (log q - log p) - 1``; ``abs``: ``|log p - log q|``.
    """

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    LOW_VAR = "low_var_kl"  # k3 clamped to [-10, 10], robust to outliers
    ABS = "abs"


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: KLEstimator | str
) -> torch.Tensor:
    """Per-token KL estimate between the policy (``log_probs``) and the reference."""
    est = KLEstimator(estimator)
    diff = log_probs - ref_log_probs
    if est is KLEstimator.K1:
        return diff
    if est is KLEstimator.ABS:
        return diff.abs()
    if est is KLEstimator.K2:
        return 0.5 * diff.square()
    ratio_log = -diff  # log q - log p
    k3 = torch.exp(ratio_log) - ratio_log - 1
    return k3.clamp(-10, 10) if est is KLEstimator.LOW_VAR else k3


class PolicyLossTerms(dict[str, torch.Tensor]):
    """``pg_loss`` plus diagnostics (``clipfrac``, ``approx_kl``, ``dual_clipfrac``), all normalized.

    ``approx_kl`` estimates KL(old policy || current policy) from the sampled tokens with the
    k3 estimator ``mean(exp(r) - 1 - r)``, ``r = log_probs - old_log_probs``: non-negative for
    every token (``exp(r) >= 1 + r``), exactly 0 when the two policies agree, unbiased because
    the tokens were sampled from the old policy.
    """


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ctx: GlobalBatchContext,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
) -> PolicyLossTerms:
    """PPO clipped surrogate with optional dual-clip (``clip_ratio_c > 1`` bounds negative advantages)."""
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(
            f"clip_ratio_c must be > 1 (or None to disable dual-clip), got {clip_ratio_c}."
        )
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    dual = torch.zeros_like(per_token)
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        dual_active = (advantages < 0) & (per_token > bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
        dual = dual_active.float()
    token_mean = LossAggregation.TOKEN_MEAN
    return PolicyLossTerms(
        pg_loss=aggregate_loss(per_token, mask, aggregation, ctx),
        clipfrac=aggregate_loss(clipfrac, mask, token_mean, ctx).detach(),
        dual_clipfrac=aggregate_loss(dual, mask, token_mean, ctx).detach(),
        # clamped: rounding must not turn a true 0 into a tiny negative
        approx_kl=aggregate_loss(
            (torch.expm1(log_ratio) - log_ratio).clamp_min(0), mask, token_mean, ctx
        ).detach(),
    )


def entropy_loss(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    ctx: GlobalBatchContext,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
) -> torch.Tensor:
    """Mean entropy (subtract ``coef * this`` from the loss for an entropy bonus)."""
    return aggregate_loss(entropy, mask, aggregation, ctx)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    ctx: GlobalBatchContext,
    *,
    clip_range: float | None = 0.2,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
) -> dict[str, torch.Tensor]:
    """Clipped value loss ``0.5 * max((v - R)^2, (clip(v, v_old ± c) - R)^2)``."""
    err = (values - returns).square()
    if clip_range is None:
        per_token = 0.5 * err
        clipfrac = torch.zeros_like(err)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        err_clipped = (clipped_values - returns).square()
        per_token = 0.5 * torch.maximum(err, err_clipped)
        # clipped only where the clamp is active: elsewhere clipped_values equals values up to
        # rounding, and comparing the two errors would count rounding noise as clipping
        active = (values - old_values).abs() > clip_range
        clipfrac = (active & (err_clipped > err)).float()
    return {
        "vf_loss": aggregate_loss(per_token, mask, aggregation, ctx),
        "vf_clipfrac": aggregate_loss(clipfrac, mask, LossAggregation.TOKEN_MEAN, ctx).detach(),
    }
