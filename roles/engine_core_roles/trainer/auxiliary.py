"""The step's calls on the roles beside the actor, each a part picked once, when the trainer is
built: the reference's log-probs (:class:`ReferencePass`), the critic's values and its update
(:class:`CriticPass`, or :class:`CriticValues` where nothing trains it); a run without such a role gets the part that does nothing
(:class:`NoReference`, :class:`NoCritic`), so the step calls every stage the same way.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from engine_core_roles.batch.keys import OLD_VALUES, REF_LOG_PROBS
from engine_core_roles.trainer.protocols import ReferenceRole, ValueRole

__all__ = [
    "CriticPass",
    "CriticStage",
    "CriticValues",
    "NoCritic",
    "NoReference",
    "ReferencePass",
    "ReferenceStage",
    "critic_stage",
    "reference_stage",
]


class NoReference:
    """A run without a reference: its batch gets no reference log-probs."""

    def __call__(self, batch: TensorDict) -> None:
        """Put the reference's log-probs of ``batch`` in it (``REF_LOG_PROBS``)."""


class ReferencePass(NoReference):
    """The reference's log-probs of the step's batch, one forward of the frozen policy."""

    def __init__(self, reference: ReferenceRole) -> None:
        self.reference = reference

    def __call__(self, batch: TensorDict) -> None:
        batch[REF_LOG_PROBS] = self.reference.compute_ref_log_prob(batch)[REF_LOG_PROBS]


ReferenceStage = NoReference
"""The reference stage's type: either part."""


def reference_stage(reference: ReferenceRole | None) -> ReferenceStage:
    return NoReference() if reference is None else ReferencePass(reference)


class NoCritic:
    """A run without a critic: no values, no update."""

    def values(self, batch: TensorDict) -> torch.Tensor | None:
        """The critic's values of ``batch`` (also put in it as ``OLD_VALUES``); None: none."""
        return None

    def update(self, batch: TensorDict) -> dict[str, float]:
        """Train the critic on ``batch``'s ``RETURNS``; returns its figures to log."""
        return {}


class CriticValues(NoCritic):
    """The critic's values before the advantages, and no update: where no estimator's returns
    train it (a plugin whose policy loss alone reads the values)."""

    def __init__(self, critic: ValueRole) -> None:
        self.critic = critic

    def values(self, batch: TensorDict) -> torch.Tensor | None:
        batch[OLD_VALUES] = values = self.critic.compute_values(batch)[OLD_VALUES]
        return values  # type: ignore[no-any-return]


class CriticPass(CriticValues):
    """The critic's values before the advantages, and its update on their returns after."""

    def update(self, batch: TensorDict) -> dict[str, float]:
        return self.critic.update_critic(batch)


CriticStage = NoCritic
"""The critic stage's type: any of the three parts."""


def critic_stage(critic: ValueRole | None, *, trained: bool) -> CriticStage:
    """The part for ``critic`` (None: the run has none, and its estimator was checked to need
    none); ``trained``: the advantage estimator returns the returns it is trained on."""
    if critic is None:
        return NoCritic()
    return CriticPass(critic) if trained else CriticValues(critic)
