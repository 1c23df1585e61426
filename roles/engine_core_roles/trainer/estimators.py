"""The step's advantages: the run's advantage estimator (a registered plugin, picked once from
``TrainerConfig.algorithm``) over the scores (shaped first by DAPO's overlong penalty, where
configured) and, when it needs a critic, the critic's values; it writes the returns that critic
is then trained on. The critic's values and update are the step's own stages
(:mod:`engine_core_roles.trainer.auxiliary`).

The estimators themselves are :class:`engine_core_roles.algorithms.base.AdvantageEstimator`
classes (the shipped ones in :mod:`engine_core_roles.algorithms.builtin`).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from engine_core import LOSS_MASK
from engine_core.hookspecs import AlgorithmNeed
from engine_core.rollout import ROLLOUT_LOG_PROBS
from engine_core_roles.algorithms.base import AdvantageInputs
from engine_core_roles.algorithms.losses import kl_penalty
from engine_core_roles.algorithms.select import (
    OverlongShaping,
    ResolvedAlgorithm,
    check_needs,
    resolve_algorithm,
)
from engine_core_roles.batch.keys import (
    ADVANTAGES,
    OLD_LOG_PROBS,
    REF_LOG_PROBS,
    RETURNS,
    UNLIKELIHOOD_WEIGHTS,
)
from engine_core_roles.trainer.config import TrainerConfig
from engine_core_roles.trainer.protocols import ValueRole

__all__ = ["Advantages", "overlong_penalty"]


def overlong_penalty(lengths: torch.Tensor, budget: int, shaping: OverlongShaping) -> torch.Tensor:
    """DAPO's soft overlong penalty per sample (``<= 0``): 0 up to ``budget - buffer`` tokens,
    then falling linearly to ``-penalty`` at ``budget`` (and staying there beyond it)."""
    start = budget - shaping.buffer
    over = (lengths.float() - start).clamp(min=0) / shaping.buffer
    return -shaping.penalty * over.clamp(max=1.0)


class Advantages:
    """Writes ``ADVANTAGES`` (and, when it trains a critic, ``RETURNS``) into a step's batch
    from its scores and the critic's values; returns the figures to log. ``critic`` (the run's,
    or None) is checked against what the estimator needs."""

    def __init__(
        self,
        config: TrainerConfig,
        critic: ValueRole | None,
        resolved: ResolvedAlgorithm | None = None,
        *,
        has_reference: bool | None = None,
    ) -> None:
        self.resolved = resolve_algorithm(config.algorithm) if resolved is None else resolved
        config.check_overlong()
        check_needs(
            self.resolved,
            has_critic=critic is not None,
            samples_per_prompt=config.samples_per_prompt,
            has_reference=has_reference,
        )
        self.estimator = self.resolved.build_estimator()
        self.config = config
        self.wants_log_probs = AlgorithmNeed.REFERENCE in self.resolved.advantage.needs
        #: whether the estimator's returns train the run's critic (written as ``RETURNS``)
        self.trains_critic = (
            AlgorithmNeed.CRITIC in self.resolved.advantage.needs and critic is not None
        )

    def __call__(
        self, batch: TensorDict, scores: torch.Tensor, values: torch.Tensor | None = None
    ) -> dict[str, float]:
        """``values``: the critic's (``OLD_VALUES``), None without one."""
        cfg, mask = self.config, batch[LOSS_MASK]
        metrics: dict[str, float] = {}
        shaping = cfg.algorithm.overlong
        if shaping is not None:
            penalty = overlong_penalty(mask.sum(-1), cfg.max_new_tokens, shaping)
            scores = scores + penalty
            metrics["reward/overlong_penalty"] = float(penalty.mean())
        token_rewards = self._kl_rewards(batch, metrics)
        n = cfg.samples_per_prompt
        groups = torch.arange(scores.numel()) // n  # a prompt's samples are adjacent
        result = self.estimator(
            AdvantageInputs(
                scores=scores,
                group_ids=groups,
                mask=mask,
                values=values,
                gamma=cfg.gamma,
                lam=cfg.lam,
                token_rewards=token_rewards,
                **(self._log_probs(batch) if self.wants_log_probs else {}),
            )
        )
        name = self.resolved.advantage.name
        if tuple(result.advantages.shape) != tuple(mask.shape):
            raise ValueError(
                f"advantage estimator {name!r} returned advantages of shape "
                f"{tuple(result.advantages.shape)} for a batch of shape {tuple(mask.shape)}; it "
                f"must return one per token ([samples, tokens])."
            )
        batch[ADVANTAGES] = result.advantages.to(torch.float32) * mask
        if result.unlikelihood_weights is not None:
            if tuple(result.unlikelihood_weights.shape) != tuple(mask.shape):
                raise ValueError(
                    f"advantage estimator {name!r} returned unlikelihood_weights of shape "
                    f"{tuple(result.unlikelihood_weights.shape)} for a batch of shape "
                    f"{tuple(mask.shape)}; it must return one per token ([samples, tokens])."
                )
            batch[UNLIKELIHOOD_WEIGHTS] = result.unlikelihood_weights.to(torch.float32) * mask
        metrics.update({f"advantage/{k}": float(v) for k, v in result.metrics.items()})
        if self.trains_critic:
            if result.returns is None:
                raise ValueError(
                    f"advantage estimator {name!r} needs a critic but returned no returns to "
                    f"train it on; return AdvantageResult(advantages, returns)."
                )
            batch[RETURNS] = result.returns
        return metrics

    @staticmethod
    def _policy_key(batch: TensorDict) -> str:
        return OLD_LOG_PROBS if OLD_LOG_PROBS in batch.keys() else ROLLOUT_LOG_PROBS

    def _log_probs(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """The policy's and the reference's log-probs, for an estimator that needs them."""
        key = self._policy_key(batch)
        missing = [k for k in (key, REF_LOG_PROBS) if k not in batch.keys()]
        if missing:
            raise ValueError(
                f"advantage estimator {self.resolved.advantage.name!r} needs the batch fields "
                f"{missing}: the reference's log-probs (pass reference=) and the policy's (the "
                f"old-log-prob pass, or a rollout that returns log-probs)."
            )
        return {"log_probs": batch[key].float(), "ref_log_probs": batch[REF_LOG_PROBS].float()}

    def _kl_rewards(self, batch: TensorDict, metrics: dict[str, float]) -> torch.Tensor | None:
        """``-coef * KL`` per loss token with kl_in_reward (the policy's side: the old-log-prob
        pass's log-probs, or the rollout's when the update computes them), else ``None``."""
        kl_cfg = self.config.algorithm.kl_in_reward
        if kl_cfg is None:
            return None
        policy_key = self._policy_key(batch)
        missing = [k for k in (policy_key, REF_LOG_PROBS) if k not in batch.keys()]
        if missing:
            raise ValueError(
                f"trainer.algorithm.kl_in_reward needs the batch fields {missing}: the reference's "
                f"log-probs (pass reference=) and the policy's (the old-log-prob pass, or a rollout "
                f"that returns log-probs)."
            )
        mask = batch[LOSS_MASK]
        kl = kl_penalty(batch[policy_key].float(), batch[REF_LOG_PROBS].float(), kl_cfg.estimator)
        rewards = -kl_cfg.coef * kl * mask
        metrics["reward/kl_penalty"] = float(rewards.sum(-1).mean())
        return rewards
