"""What the trainer calls on its parts: the roles (in-process or worker groups) and the prompt
source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from tensordict import TensorDict

from engine_core_roles.distributed.placement import ActorGroup
from engine_core_roles.models.actor import Actor

__all__ = ["PromptBatch", "PromptSource", "PolicyRole", "ValueRole", "ReferenceRole", "RewardRole"]

PromptBatch = torch.Tensor | TensorDict


PromptSource = Iterable[PromptBatch] | Callable[[int], PromptBatch]
"""Each step's prompts: an iterable, or a callable taking the step number. A prompt batch is a
``[B, P]`` tensor of token ids, or the :func:`engine_core_roles.prompt_batch` of left-padded ones."""


PolicyRole = Actor | ActorGroup
"""The policy the trainer updates and whose weights reach the rollout through its
:class:`~engine_core_roles.distributed.weights.WeightLink`: an :class:`Actor` in this process, or
an :class:`~engine_core_roles.distributed.placement.ActorGroup` (the same calls on a
data-parallel worker group). Exactly the ends the link connects."""


class ValueRole(Protocol):
    """A :class:`Critic` or a :class:`engine_core_roles.distributed.placement.CriticGroup`."""

    def compute_values(self, batch: TensorDict) -> TensorDict: ...

    def update_critic(self, batch: TensorDict) -> dict[str, float]: ...


class ReferenceRole(Protocol):
    """A :class:`Reference` or a :class:`engine_core_roles.distributed.placement.ReferenceGroup`."""

    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict: ...


class RewardRole(Protocol):
    """A :class:`engine_core_roles.RewardModel` or a :class:`engine_core_roles.distributed.placement.RewardModelGroup`."""

    def compute_rm_score(self, batch: TensorDict) -> TensorDict: ...
