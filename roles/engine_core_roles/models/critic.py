"""``Critic``: per-token values and clipped value-loss updates, on any engine with a value head."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pydantic import Field, PositiveInt, field_validator
from tensordict import TensorDict

from engine_core import (
    LOSS_MASK,
    VALUES,
    BaseEngine,
    CapabilityError,
    FrozenModel,
    GlobalBatchContext,
    LossAggregation,
    Metric,
    require_keys,
    require_token_shaped,
)
from engine_core_roles.algorithms.losses import value_loss
from engine_core_roles.algorithms.updates import mean_over_steps, run_updates, warn_skipped
from engine_core_roles.batch.keys import OLD_VALUES, RETURNS

__all__ = [
    "CriticConfig",
    "Critic",
]

PRODUCERS = {
    OLD_VALUES: "Critic.compute_values",
    RETURNS: "engine_core_roles.algorithms.advantages.gae_advantages",
    LOSS_MASK: "the rollout (response mask)",
}


class CriticConfig(FrozenModel):
    """How the critic is updated: epochs, mini-batches, value clipping, loss aggregation."""

    ppo_epochs: PositiveInt = Field(1, description="Passes over each batch per update.")
    ppo_mini_batch_size: PositiveInt | None = Field(
        None, description="Samples per optimizer step (global); None: one step per epoch."
    )
    cliprange_value: float | None = Field(
        0.5, gt=0, description="Clip new values to old ± this; None: no value clipping."
    )
    loss_agg_mode: LossAggregation = Field(
        LossAggregation.TOKEN_MEAN,
        description="How per-token value losses are aggregated (token-mean, seq-mean-token-mean "
        "or seq-mean-token-sum).",
    )

    @field_validator("loss_agg_mode")
    @classmethod
    def _no_norm_length(cls, mode: LossAggregation) -> LossAggregation:
        if mode is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM:
            raise ValueError(
                f"critic.loss_agg_mode={mode} is a policy-loss choice (Dr. GRPO's); the value "
                f"loss takes token-mean, seq-mean-token-mean or seq-mean-token-sum."
            )
        return mode


class Critic:
    """The value function. ``engine`` must be built with ``model.value_head=True``."""

    def __init__(self, config: CriticConfig, engine: BaseEngine) -> None:
        if not engine.config.model.value_head:
            raise CapabilityError(
                "Critic needs an engine whose model has a value head; set "
                "model.value_head=true in the critic's engine config."
            )
        self.config = config
        self.engine = engine

    def compute_values(self, batch: TensorDict) -> TensorDict:
        """Per-token values aligned to ``input_ids`` (``old_values`` for the update)."""
        self.engine.set_loss_fn(None)
        with self.engine.eval_mode():
            out = self.engine.forward_backward_step(batch, forward_only=True)
        return TensorDict({OLD_VALUES: out.outputs[VALUES]}, batch_size=batch.batch_size)

    def loss_fn(
        self, mb: TensorDict, out: TensorDict, ctx: GlobalBatchContext
    ) -> tuple[torch.Tensor, Mapping[str, Metric]]:
        terms = value_loss(
            out[VALUES],
            mb[OLD_VALUES],
            mb[RETURNS],
            mb[LOSS_MASK],
            ctx,
            clip_range=self.config.cliprange_value,
            aggregation=self.config.loss_agg_mode,
        )
        return terms["vf_loss"], {k: Metric.of(v, "sum") for k, v in terms.items()}

    def update_critic(self, batch: TensorDict) -> dict[str, float]:
        require_keys(
            batch,
            [LOSS_MASK, OLD_VALUES, RETURNS],
            method="Critic.update_critic",
            producers=PRODUCERS,
        )
        require_token_shaped(batch, [LOSS_MASK, OLD_VALUES, RETURNS], method="Critic.update_critic")
        history, lr, _ = run_updates(
            self.engine,
            batch,
            self.loss_fn,
            epochs=self.config.ppo_epochs,
            global_mini_batch_size=self.config.ppo_mini_batch_size,
            log_loss=False,
        )
        out = mean_over_steps("critic", history, lr=lr)
        if out["critic/num_skipped_steps"]:
            warn_skipped(
                "Critic.update_critic", int(out["critic/num_skipped_steps"]), len(history), batch
            )
        return out
