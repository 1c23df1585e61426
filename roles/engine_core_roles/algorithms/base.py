"""What an advantage estimator and a policy loss are: the two kinds of algorithm a plugin adds.

An **advantage estimator** turns each sample's score (and, for one that needs a critic, the
critic's values) into per-token advantages; a **policy loss** turns the actor's log-probs and
those advantages into this micro-batch's share of the loss. Both are classes registered by
name through the plugin system (:meth:`engine_core.hookspecs.BackendRegistry.register_advantage`
and ``register_policy_loss``), each built once per run from its validated parameters::

    class MyEstimator(AdvantageEstimator):
        def __init__(self, params: MyParams) -> None:
            self.params = params

        def __call__(self, inputs: AdvantageInputs) -> AdvantageResult:
            ...

A policy loss must keep the loss contract (:mod:`engine_core.loss`): every term it returns is
this micro-batch's share of the mini-batch value (normalized by the global counts of
``inputs.ctx``, e.g. through :func:`engine_core.aggregate_loss`), so that summed over
micro-batches and data-parallel ranks it does not depend on how the batch was split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel

from engine_core import FrozenModel, GlobalBatchContext, LossAggregation
from engine_core_roles.algorithms.advantages import sequence_to_token_rewards

__all__ = [
    "NoParams",
    "AdvantageInputs",
    "AdvantageResult",
    "AdvantageEstimator",
    "PolicyLossInputs",
    "PolicyLoss",
]


class NoParams(FrozenModel):
    """The parameters of an algorithm that takes none (any key given is refused)."""


@dataclass(frozen=True)
class AdvantageInputs:
    """One step's samples, as an estimator sees them.

    ``scores`` ``[N]``: each sample's reward. ``group_ids`` ``[N]``: the prompt each sample
    answers (samples of one prompt share an id). ``mask`` ``[N, L]``: the response tokens that
    carry a loss. ``values`` ``[N, L]``: the critic's values, only for an estimator that needs a
    critic (else ``None``). ``gamma`` and ``lam``: the run's discount and GAE lambda
    (``trainer.gamma``, ``trainer.lam``). ``token_rewards`` ``[N, L]``: rewards on single
    tokens besides the score (``-coef * KL`` per token with ``algorithm.kl_in_reward``), or
    ``None``; an estimator reads the total through :meth:`sequence_rewards` (per sample) or
    :meth:`per_token_rewards` (per token). ``log_probs`` and ``ref_log_probs`` ``[N, L]``: the
    policy's log-probs of the sampled tokens (the old-log-prob pass's, or the rollout's when the
    update computes them) and the reference's, given to an estimator that needs a reference
    (else ``None``).
    """

    scores: torch.Tensor
    group_ids: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    token_rewards: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None

    def sequence_rewards(self) -> torch.Tensor:
        """``[N]``: each sample's score plus its token rewards over its loss tokens."""
        scores = self.scores.float()
        if self.token_rewards is None:
            return scores
        return scores + (self.token_rewards * self.mask.to(scores.dtype)).sum(-1)

    def per_token_rewards(self) -> torch.Tensor:
        """``[N, L]``: each sample's score on its last loss token, plus its token rewards."""
        rewards = sequence_to_token_rewards(self.scores.float(), self.mask)
        if self.token_rewards is None:
            return rewards
        return rewards + self.token_rewards * self.mask.to(rewards.dtype)


@dataclass(frozen=True)
class AdvantageResult:
    """``advantages`` ``[N, L]`` (0 off the mask); ``returns`` ``[N, L]`` when a critic is
    trained on them (else ``None``); ``metrics``: figures to log under ``advantage/``;
    ``unlikelihood_weights`` ``[N, L]``: where the estimator asks the actor to make the sampled
    tokens less likely whatever their advantage, each token's weight of the unlikelihood term
    (:func:`~engine_core_roles.algorithms.losses.unlikelihood_loss`; else ``None``)."""

    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    unlikelihood_weights: torch.Tensor | None = None


class AdvantageEstimator(ABC):
    """Per-token advantages from scores; built once per run as ``cls(params)``."""

    def __init__(self, params: BaseModel) -> None:
        self.params = params

    @abstractmethod
    def __call__(self, inputs: AdvantageInputs) -> AdvantageResult:
        """The step's advantages (and returns, for a critic)."""


@dataclass(frozen=True)
class PolicyLossInputs:
    """One micro-batch, as a policy loss sees it.

    All tensors are ``[B, L]``, aligned to the tokens: ``log_probs`` (with gradient),
    ``old_log_probs`` (the policy the samples' advantages were computed for, detached),
    ``advantages``, ``mask`` (the loss tokens), and ``weights`` (the mismatch correction's
    per-token weights, or ``None``). ``ctx``: the global counts. ``aggregation``: how per-token
    values become one number (``actor.loss_agg_mode``); ``norm_length``: the constant of
    ``seq-mean-token-sum-norm``.
    A loss's own settings (a clip range, say) are its ``params``, not inputs.
    """

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ctx: GlobalBatchContext
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    norm_length: int | None = None
    weights: torch.Tensor | None = None


class PolicyLoss(ABC):
    """The policy-gradient term of the actor's loss; built once per actor as ``cls(params)``."""

    def __init__(self, params: BaseModel) -> None:
        self.params = params

    @abstractmethod
    def __call__(self, inputs: PolicyLossInputs) -> dict[str, torch.Tensor]:
        """``pg_loss`` (with gradient) and diagnostics (detached), each this micro-batch's share
        of the mini-batch value: summed over micro-batches and ranks they are logged as
        ``actor/<name>``."""
