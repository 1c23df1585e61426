"""Advantage estimators: the step's advantages (and, for those with a critic, its values, returns
and update), one call of an estimator the trainer picks once from ``TrainerConfig.algorithm``.

:data:`ESTIMATORS` maps each algorithm to how its estimator is built; a new algorithm is a new
entry. The maths are the pure functions of :mod:`engine_core_roles.algorithms.advantages`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from tensordict import TensorDict

from engine_core import LOSS_MASK
from engine_core_roles.algorithms.advantages import (
    gae_advantages,
    grpo_advantages,
    sequence_to_token_rewards,
    whiten,
)
from engine_core_roles.batch.keys import ADVANTAGES, OLD_VALUES, RETURNS
from engine_core_roles.trainer.config import TrainerConfig
from engine_core_roles.trainer.protocols import ValueRole

__all__ = ["ESTIMATORS", "AdvantageEstimator", "CriticGAE", "GroupNormalized", "estimator_for"]


class AdvantageEstimator(Protocol):
    """Writes ``ADVANTAGES`` (``[B*n, L]``, zero off the loss mask) into ``batch`` from each
    sample's ``scores`` ``[B*n]`` (``n`` adjacent samples per prompt); returns figures to log."""

    def __call__(self, batch: TensorDict, scores: torch.Tensor) -> dict[str, float]: ...


class GroupNormalized:
    """GRPO: each sample's score normalized within its prompt's group, on every token."""

    def __init__(self, samples_per_prompt: int) -> None:
        self.n = samples_per_prompt

    def __call__(self, batch: TensorDict, scores: torch.Tensor) -> dict[str, float]:
        groups = torch.arange(scores.numel() // self.n).repeat_interleave(self.n)
        batch[ADVANTAGES] = grpo_advantages(scores, groups).unsqueeze(1) * batch[LOSS_MASK]
        return {}


class CriticGAE:
    """PPO: GAE over the critic's values (whitened), then the critic's update on the returns."""

    def __init__(self, critic: ValueRole, gamma: float, lam: float) -> None:
        self.critic, self.gamma, self.lam = critic, gamma, lam

    def __call__(self, batch: TensorDict, scores: torch.Tensor) -> dict[str, float]:
        mask = batch[LOSS_MASK]
        batch[OLD_VALUES] = self.critic.compute_values(batch)[OLD_VALUES]
        token_rewards = sequence_to_token_rewards(scores, mask)
        adv, batch[RETURNS] = gae_advantages(
            token_rewards, batch[OLD_VALUES], mask, gamma=self.gamma, lam=self.lam
        )
        batch[ADVANTAGES] = whiten(adv, mask)
        return self.critic.update_critic(batch)


ESTIMATORS: dict[str, Callable[[TrainerConfig, ValueRole | None], AdvantageEstimator]] = {
    "grpo": lambda config, critic: GroupNormalized(config.samples_per_prompt),
    "ppo": lambda config, critic: CriticGAE(_needs(critic), config.gamma, config.lam),
}


def _needs(critic: ValueRole | None) -> ValueRole:
    if critic is None:
        raise ValueError("algorithm='ppo' estimates advantages with a critic; pass critic=.")
    return critic


def estimator_for(config: TrainerConfig, critic: ValueRole | None) -> AdvantageEstimator:
    """The estimator of ``config.algorithm``."""
    return ESTIMATORS[config.algorithm](config, critic)
