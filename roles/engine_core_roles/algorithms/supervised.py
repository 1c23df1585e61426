"""The supervised step every job shares: token-mean negative log-likelihood on the loss mask, one
forward/backward and one optimizer step through any engine.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from engine_core.batch import LOG_PROBS
from engine_core.engine import BaseEngine, loss_mask_of
from engine_core.loss import GlobalBatchContext, Metric, aggregate_loss, token_mean_metric

__all__ = ["sft_loss", "supervised_step"]


def sft_loss(
    mb: TensorDict, out: TensorDict, ctx: GlobalBatchContext
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Token-mean negative log-likelihood on the loss mask."""
    mask = loss_mask_of(mb)
    nll = -out[LOG_PROBS]
    return aggregate_loss(nll, mask, "token-mean", ctx), {
        "target_prob": token_mean_metric(out[LOG_PROBS].exp(), mask, ctx)
    }


def supervised_step(engine: BaseEngine, batch: TensorDict) -> float:
    """One supervised step on ``batch`` (:func:`sft_loss` on its loss mask): forward and
    backward, the optimizer's step. The engine's loss function is put back after. Returns the
    loss."""
    previous = engine.loss_fn
    engine.set_loss_fn(sft_loss)
    try:
        with engine.train_mode():
            result = engine.forward_backward_step(batch)
            engine.optimizer_step()
            engine.optimizer_zero_grad()
    finally:
        engine.set_loss_fn(previous)
    return float(result.loss or 0.0)
