"""RL losses as pure functions on per-token tensors, normalized by the global-batch context.

Every loss returns this micro-batch's share of the mini-batch loss (see
:mod:`engine_core.loss`): summed over micro-batches and DP ranks it is the mini-batch mean, so
gradients and logged values do not depend on how the batch was split.

:func:`tis_weights` and :func:`mis_weights` correct the policy loss for the mismatch between
the rollout's log-probs of the sampled tokens and the trainer's (``old_log_probs``): their
per-token weights go to :func:`policy_loss` as ``weights``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from engine_core import GlobalBatchContext, LossAggregation, aggregate_loss
from engine_core.capabilities import StrEnum

__all__ = [
    "KLEstimator",
    "kl_penalty",
    "MismatchCorrection",
    "MISLevel",
    "CorrectionWeights",
    "tis_weights",
    "mis_weights",
    "policy_loss",
    "gspo_loss",
    "cispo_loss",
    "value_loss",
    "entropy_loss",
    "unlikelihood_loss",
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


class MismatchCorrection(StrEnum):
    """How the policy loss corrects for rollout/trainer log-prob mismatch.

    The rollout samples with its own kernels (and precision), so its log-probs of the sampled
    tokens differ from the trainer's ``old_log_probs``, against which the PPO ratio is taken.
    With ``ratio = exp(old_log_probs - rollout_log_probs)``: ``tis`` weights each token by the
    truncated ratio (:func:`tis_weights`), ``mis`` drops the tokens (or whole sequences) whose
    ratio leaves a band (:func:`mis_weights`), ``none`` uses every token as it is.
    """

    NONE = "none"
    TIS = "tis"
    MIS = "mis"


class MISLevel(StrEnum):
    """What :func:`mis_weights` drops: single tokens, or whole responses."""

    TOKEN = "token"
    SEQUENCE = "sequence"


class CorrectionWeights(NamedTuple):
    """Per-token multipliers of the policy-gradient loss, detached, and their diagnostics.

    ``metrics`` holds one fraction of loss tokens (``tis_truncated_frac`` or
    ``mis_masked_frac``), normalized like ``clipfrac``: this micro-batch's share of the global
    mean, to be reduced with ``sum``.
    """

    weights: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _mismatch_log_ratio(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor
) -> torch.Tensor:
    return (old_log_probs - rollout_log_probs).detach()


def tis_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    ctx: GlobalBatchContext,
    *,
    cap: float = 2.0,
) -> CorrectionWeights:
    """Truncated importance sampling: ``w = min(exp(old_log_probs - rollout_log_probs), cap)``.

    ``cap`` must be > 0; ``math.inf`` gives untruncated importance sampling. Reports
    ``tis_truncated_frac``, the fraction of loss tokens whose ratio exceeds ``cap``.
    """
    if not cap > 0:  # NaN included
        raise ValueError(
            f"tis cap must be > 0 (math.inf: no truncation), got {cap}; the usual value is 2."
        )
    log_ratio = _mismatch_log_ratio(old_log_probs, rollout_log_probs)
    log_cap = math.log(cap)
    # truncated in log space: exp stays finite under a finite cap, and a ratio of 1 weighs 1
    weights = torch.exp(log_ratio.clamp(max=log_cap))
    truncated = (log_ratio > log_cap).to(weights.dtype)
    frac = aggregate_loss(truncated, mask, LossAggregation.TOKEN_MEAN, ctx)
    return CorrectionWeights(weights, {"tis_truncated_frac": frac})


def mis_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    ctx: GlobalBatchContext,
    *,
    low: float = 0.5,
    high: float = 2.0,
    level: MISLevel | str = MISLevel.TOKEN,
) -> CorrectionWeights:
    """Masked importance sampling: weight 0 where ``exp(old_log_probs - rollout_log_probs)``
    leaves ``[low, high]``, 1 elsewhere.

    At ``level="sequence"`` a response is dropped whole when its geometric-mean ratio (``exp``
    of the mean log-ratio over its loss tokens) leaves the band. The band must hold 1
    (``0 <= low <= 1 <= high``: a token on which rollout and trainer agree is always kept);
    ``low=0, high=math.inf`` keeps every token. Reports ``mis_masked_frac``, the fraction of
    loss tokens dropped.
    """
    if not 0 <= low <= 1 <= high:  # NaN included
        raise ValueError(
            f"the mis band must satisfy 0 <= low <= 1 <= high (it must hold the ratio 1, where "
            f"rollout and trainer agree), got low={low}, high={high}."
        )
    level = MISLevel(level)
    log_ratio = _mismatch_log_ratio(old_log_probs, rollout_log_probs)
    if level is MISLevel.SEQUENCE:
        on = mask.bool()
        # where(), not a product: outside the mask (the prompt) the log-ratio may be anything
        total = torch.where(on, log_ratio, torch.zeros_like(log_ratio)).sum(-1)
        mean = total / on.sum(-1).clamp_min(1)
        log_ratio = mean.unsqueeze(-1).expand_as(log_ratio)
    log_low = math.log(low) if low > 0 else -math.inf
    keep = (log_ratio >= log_low) & (log_ratio <= math.log(high))
    weights = keep.to(old_log_probs.dtype)
    frac = aggregate_loss(1 - weights, mask, LossAggregation.TOKEN_MEAN, ctx)
    return CorrectionWeights(weights, {"mis_masked_frac": frac})


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
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
    weights: torch.Tensor | None = None,
    norm_length: int | None = None,
) -> PolicyLossTerms:
    """PPO clipped surrogate with optional dual-clip (``clip_ratio_c > 1`` bounds negative advantages).

    ``weights`` (from :func:`tis_weights` or :func:`mis_weights`) multiply the per-token loss
    and are constants to the gradient. A token of weight 0 still counts in the denominator
    (the global loss-token count, or its sequence's token count), so the loss keeps the scale
    of a mean over every loss token and masking more tokens never enlarges the others' step.
    The diagnostics stay unweighted, over every loss token.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(
            f"clip_ratio_c must be > 1 (or None to disable dual-clip), got {clip_ratio_c}."
        )
    if weights is not None and weights.shape != log_probs.shape:
        raise ValueError(
            f"weights have shape {tuple(weights.shape)} but log_probs {tuple(log_probs.shape)}; "
            f"pass one weight per token."
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
    if weights is not None:
        per_token = per_token * weights.detach()
    token_mean = LossAggregation.TOKEN_MEAN
    pg_loss = aggregate_loss(per_token, mask, aggregation, ctx, norm_length=norm_length)
    with torch.no_grad():  # diagnostics: no graph to build
        return PolicyLossTerms(
            pg_loss=pg_loss,
            clipfrac=aggregate_loss(clipfrac, mask, token_mean, ctx),
            dual_clipfrac=aggregate_loss(dual, mask, token_mean, ctx),
            approx_kl=_approx_kl(log_ratio, mask, ctx),
        )


def _approx_kl(
    log_ratio: torch.Tensor, mask: torch.Tensor, ctx: GlobalBatchContext
) -> torch.Tensor:
    # k3 of KL(old || current), clamped: rounding must not turn a true 0 into a tiny negative
    log_ratio = log_ratio.detach()
    k3 = (torch.expm1(log_ratio) - log_ratio).clamp_min(0)
    return aggregate_loss(k3, mask, LossAggregation.TOKEN_MEAN, ctx)


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ctx: GlobalBatchContext,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    aggregation: LossAggregation | str = LossAggregation.SEQ_MEAN_TOKEN_MEAN,
    norm_length: int | None = None,
    weights: torch.Tensor | None = None,
) -> PolicyLossTerms:
    """GSPO: one importance ratio per sequence, ``s = exp(mean_t(log_probs - old_log_probs))``
    over its loss tokens, clipped to ``[1 - low, 1 + high]`` PPO-style against its advantage.

    Each token carries ``s_t = sg(s) * exp(log_prob_t - sg(log_prob_t))``: equal to ``s`` in
    value, with the gradient ``s * grad log_prob_t`` (GSPO-token, which equals sequence-level
    GSPO when a sequence's advantages are one number). ``clipfrac`` counts the loss tokens of
    clipped sequences.
    """
    on = mask.bool()
    token_log_ratio = torch.where(on, log_probs - old_log_probs, torch.zeros_like(log_probs))
    seq_log_ratio = token_log_ratio.sum(-1) / on.sum(-1).clamp_min(1)
    # the sequence's ratio in value, each token's own gradient; clamped as policy_loss does
    log_ratio = (seq_log_ratio.detach().unsqueeze(-1) + log_probs - log_probs.detach()).clamp(
        -20.0, 20.0
    )
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach()
    token_mean = LossAggregation.TOKEN_MEAN
    return PolicyLossTerms(
        pg_loss=aggregate_loss(per_token, mask, aggregation, ctx, norm_length=norm_length),
        clipfrac=aggregate_loss((clipped > unclipped).float(), mask, token_mean, ctx).detach(),
        approx_kl=_approx_kl(token_log_ratio.clamp(-20.0, 20.0), mask, ctx),
    )


def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ctx: GlobalBatchContext,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
    norm_length: int | None = None,
    weights: torch.Tensor | None = None,
) -> PolicyLossTerms:
    """CISPO: ``-sg(clip(ratio, 1 - low, 1 + high)) * advantage * log_prob`` per token.

    The importance weight is clipped and detached, the gradient flows through ``log_prob``, so
    no token's gradient is dropped (PPO's clip zeroes the clipped tokens'). ``low=1`` puts no
    lower bound on the weight. ``clipfrac`` counts the tokens whose weight was clipped.
    """
    log_ratio = (log_probs - old_log_probs).detach().clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = -weight * advantages * log_probs
    if weights is not None:
        per_token = per_token * weights.detach()
    clipped = (weight != ratio).float()
    token_mean = LossAggregation.TOKEN_MEAN
    return PolicyLossTerms(
        pg_loss=aggregate_loss(per_token, mask, aggregation, ctx, norm_length=norm_length),
        clipfrac=aggregate_loss(clipped, mask, token_mean, ctx).detach(),
        approx_kl=_approx_kl(log_ratio, mask, ctx),
    )


def entropy_loss(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    ctx: GlobalBatchContext,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
    *,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Mean entropy (subtract ``coef * this`` from the loss for an entropy bonus)."""
    return aggregate_loss(entropy, mask, aggregation, ctx, norm_length=norm_length)


def unlikelihood_loss(
    log_probs: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    ctx: GlobalBatchContext,
    aggregation: LossAggregation | str = LossAggregation.TOKEN_MEAN,
    *,
    norm_length: int | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Weighted unlikelihood of the sampled tokens, ``w * -log(1 - p)`` with ``p`` the token's
    probability (at most ``1 - eps``), aggregated like the policy loss; add it to the loss.

    Minimizing it makes the weighted tokens less likely. Its gradient in the token's logit is
    ``w * p``, which stays near ``w`` as the policy grows sure of the token, where a policy
    gradient's ``-A * (1 - p)`` vanishes: it moves a policy off an answer it is certain of."""
    p = log_probs.exp().clamp(max=1 - eps)
    per_token = -torch.log1p(-p) * weights.detach()
    return aggregate_loss(per_token, mask, aggregation, ctx, norm_length=norm_length)


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
