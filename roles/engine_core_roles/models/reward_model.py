"""``RewardModel``: scalar scores from a sequence-classification reward model, on any engine.

A Hugging Face sequence-classification checkpoint (``*ForSequenceClassification`` with one
label) and the engine's value-head model (``*ForTokenClassification``) share their weight
names: the backbone plus a ``score`` head. The engine loads the checkpoint with
``model.value_head=true``, computes the head's output at every token (``values_at_token``), and
the reward model reads it at each sequence's last real token — exactly what sequence classification pools.

Rule-based rewards need no model: any ``callable(batch) -> scores [B]`` (see
:mod:`engine_core_roles.data.tasks.digits`) fills the same ``rm_scores`` field.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from engine_core import (
    ATTENTION_MASK,
    VALUES,
    BaseEngine,
    CapabilityError,
    require_keys,
    with_meta,
)
from engine_core_roles.algorithms.advantages import sequence_to_token_rewards
from engine_core_roles.batch.keys import RM_SCORES, TOKEN_LEVEL_SCORES

__all__ = ["RewardModel", "last_token_index"]


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token (left or right padding)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return torch.where(attention_mask.bool(), positions, -1).max(-1).values


class RewardModel:
    """Scores prompt + response sequences. ``engine`` must have ``model.value_head=True``."""

    def __init__(self, engine: BaseEngine) -> None:
        if not engine.config.model.value_head:
            raise CapabilityError(
                "RewardModel needs an engine whose model has a scalar head; set "
                "model.value_head=true (and model.path to the sequence-classification "
                "checkpoint) in the reward model's engine config."
            )
        self.engine = engine

    def compute_rm_score(self, batch: TensorDict) -> TensorDict:
        """``rm_scores`` [B] and ``token_level_scores`` [B, L] (score on the last real token)."""
        require_keys(batch, ["input_ids", ATTENTION_MASK], method="RewardModel.compute_rm_score")
        mask = batch[ATTENTION_MASK]
        empty = ~mask.bool().any(-1)
        if empty.any():
            rows = empty.nonzero().squeeze(-1).tolist()[:8]
            raise ValueError(
                f"RewardModel.compute_rm_score: row(s) {rows} have no real token "
                f"(all-zero attention_mask); drop them before scoring."
            )
        batch = with_meta(batch, values_at_token=True)
        self.engine.set_loss_fn(None)
        with self.engine.eval_mode():
            out = self.engine.forward_backward_step(batch, forward_only=True)
        values = out.outputs[VALUES]
        last = last_token_index(mask)
        scores = values.gather(-1, last.unsqueeze(-1).to(values.device)).squeeze(-1)
        return TensorDict(
            {RM_SCORES: scores, TOKEN_LEVEL_SCORES: sequence_to_token_rewards(scores, mask)},
            batch_size=batch.batch_size,
        )
