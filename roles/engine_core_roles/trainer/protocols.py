"""What the trainer calls on its parts: the roles (in-process or worker groups), the prompt source and
the step callbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from tensordict import TensorDict

from engine_core_roles.roles.actor import ActorConfig, ActorUpdate

__all__ = ["PromptBatch", "PromptSource", "PolicyRole", "ValueRole", "ReferenceRole", "RewardRole"]

PromptBatch = torch.Tensor | TensorDict


PromptSource = Iterable[PromptBatch] | Callable[[int], PromptBatch]
"""Each step's prompts: an iterable, or a callable taking the step number. A prompt batch is a
``[B, P]`` tensor of token ids, or the :func:`engine_core_roles.prompt_batch` of left-padded ones."""


class PolicyRole(Protocol):
    """What the trainer calls on the policy: an :class:`Actor`, or an
    :class:`engine_core_roles.distributed.placement.ActorGroup` (the same calls on a data-parallel worker group).

    Its weights reach the rollout through a :class:`engine_core_roles.distributed.weights.WeightLink`."""

    config: ActorConfig

    def compute_log_prob(self, batch: TensorDict) -> TensorDict: ...

    def update_actor(self, batch: TensorDict) -> ActorUpdate: ...

    @property
    def max_position_embeddings(self) -> int | None: ...


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
