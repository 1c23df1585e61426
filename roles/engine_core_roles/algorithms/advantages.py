"""Advantage estimators and KL-in-reward controllers, as pure functions.

Tensors are ``[batch, seq_len]`` with a response ``mask``; rewards are per token (a sequence
reward sits on the last response token) or per sequence (``[batch]``) where noted.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "whiten",
    "gae_advantages",
    "grpo_advantages",
    "rloo_advantages",
    "discounted_returns",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "group_mean_term",
    "signal_groups",
    "stalled_groups",
    "sequence_to_token_rewards",
    "FixedKLController",
    "AdaptiveKLController",
]


def sequence_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's score on its last masked token."""
    rewards = torch.zeros(
        mask.shape, dtype=scores.dtype if scores.is_floating_point() else torch.float32
    )
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask.bool(), positions, -1).max(-1).values
    has = last >= 0
    rewards[has, last[has]] = scores[has].to(rewards.dtype)
    return rewards


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over masked tokens; returns (advantages, returns).

    Masked-out positions are skipped (the recursion jumps over them), so left or right padding
    of the response does not change the result.
    """
    mask_f = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0], dtype=values.dtype)
    running = torch.zeros(values.shape[0], dtype=values.dtype)
    for t in reversed(range(values.shape[1])):
        m = mask_f[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        new_running = delta + gamma * lam * running
        running = m * new_running + (1 - m) * running
        next_value = m * values[:, t] + (1 - m) * next_value
        advantages[:, t] = running * m
    returns = (advantages + values) * mask_f
    return advantages, returns


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero-mean, unit-variance over the masked entries (0 elsewhere)."""
    m = mask.bool()
    vals = x[m]
    if vals.numel() == 0:  # nothing to whiten: the mean of nothing would be NaN
        return torch.zeros_like(x)
    std = vals.std(unbiased=False) if vals.numel() > 1 else torch.ones(())
    return ((x - vals.mean()) / (std + eps)) * m


def _group_ids(index: torch.Tensor) -> tuple[torch.Tensor, int]:
    uniq, inverse = torch.unique(index, return_inverse=True)
    return inverse, int(uniq.numel())


def _group_sums(
    scores: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample's group id, and per group the count and the sum of ``scores``."""
    gid, n = _group_ids(group_index)
    count = torch.zeros(n).index_add_(0, gid, torch.ones_like(scores))
    total = torch.zeros(n).index_add_(0, gid, scores)
    return gid, count, total


def grpo_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-normalized advantages per sequence: ``(r - mean_group) / (std_group + eps)``.

    ``group_index`` gives each sample's prompt id; std is the unbiased sample std (a group of
    one gets advantage 0).
    """
    scores = scores.float()
    gid, count, total = _group_sums(scores, group_index)
    centered = scores - (total / count)[gid]
    if not normalize_std:
        return centered
    sq = torch.zeros_like(count).index_add_(0, gid, centered.square())
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    std = torch.where(count > 1, std, torch.zeros_like(std))
    return centered / (std[gid] + eps)


def group_mean_term(
    scores: torch.Tensor, group_index: torch.Tensor, *, eps: float = 1e-6
) -> torch.Tensor:
    """Each sample's group mean against the batch: ``(mean_g - mean_B) / (std_B + eps)`` over
    the batch's scores (``std_B`` unbiased; 0 for a batch of one score).

    Added to :func:`grpo_advantages` (``GRPOParams.group_mean_weight``), it keeps what group
    normalization drops: a group whose samples all scored the same gets 0 there, whether they
    are all right or all equally wrong; here a group below the batch is pushed away from its
    samples (every token of them less likely), one above it towards them."""
    scores = scores.float()
    if scores.numel() < 2:
        return torch.zeros_like(scores)
    gid, count, total = _group_sums(scores, group_index)
    return ((total / count)[gid] - scores.mean()) / (scores.std() + eps)


def signal_groups(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Each sample's flag: does its group hold two different scores (so that group
    normalization gives it a non-zero advantage)?"""
    scores = scores.float()
    gid, n = _group_ids(group_index)
    low = torch.full((n,), math.inf).scatter_reduce(0, gid, scores, "amin")
    high = torch.full((n,), -math.inf).scatter_reduce(0, gid, scores, "amax")
    return (high > low)[gid]


def stalled_groups(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Each sample's flag: did every sample of its group score the same, below the batch's best
    score? Group normalization gives such a group 0, so nothing moves the policy off an answer
    it gives every time while other prompts already score better (a group all at the batch's
    best is not flagged: it may be all right)."""
    scores = scores.float()
    if scores.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    return ~signal_groups(scores, group_index) & (scores < scores.max())


def rloo_advantages(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: ``r_i - mean_{j != i} r_j`` within each group (0 for groups of one)."""
    scores = scores.float()
    gid, count, total = _group_sums(scores, group_index)
    others = count[gid] - 1
    baseline = (total[gid] - scores) / others.clamp_min(1)
    return torch.where(others > 0, scores - baseline, torch.zeros_like(scores))


def discounted_returns(
    rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0
) -> torch.Tensor:
    """Per-token returns ``G_t = r_t + gamma * G_{t+1}`` over the masked tokens (0 elsewhere).

    Like :func:`gae_advantages`, the recursion jumps over masked-out positions, so padding inside
    or around the response does not change the result.
    """
    mask_f = mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        m = mask_f[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    return returns


def reinforce_pp_advantages(
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    token_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++: each token's discounted return of the sequence's score (placed on its last
    loss token, plus ``token_rewards`` where given), whitened over every loss token of the
    batch."""
    rewards = sequence_to_token_rewards(scores.float(), mask)
    if token_rewards is not None:
        rewards = rewards + token_rewards * mask.to(rewards.dtype)
    return whiten(discounted_returns(rewards, mask, gamma=gamma), mask)


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++ with a baseline: each score minus its group's mean, on every loss token,
    whitened over every loss token of the batch."""
    centered = grpo_advantages(scores, group_index, normalize_std=False)
    return whiten(centered.unsqueeze(1) * mask.to(centered.dtype), mask)


class FixedKLController:
    """A constant KL-in-reward coefficient."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}.")
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    """Adjusts the coefficient so the observed KL tracks ``target`` over ``horizon`` samples."""

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if init_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"need init_coef >= 0, target > 0, horizon > 0; got {init_coef}, {target}, {horizon}."
            )
        self.value, self.target, self.horizon = init_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        if not math.isfinite(current_kl):
            return self.value
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon
        return self.value
