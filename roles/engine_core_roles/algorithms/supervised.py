"""The supervised step every job shares: token-mean negative log-likelihood on the loss mask, one
forward/backward, one optimizer step and one step of the LR schedule through any engine; and the
same loss measured without a step (validation).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from tensordict import TensorDict

from engine_core.batch import LOG_PROBS
from engine_core.engine import BaseEngine, loss_mask_of
from engine_core.loss import GlobalBatchContext, Metric, aggregate_loss, token_mean_metric

__all__ = ["sft_loss", "supervised_step", "supervised_loss"]


def sft_loss(
    mb: TensorDict, out: TensorDict, ctx: GlobalBatchContext
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Token-mean negative log-likelihood on the loss mask."""
    mask = loss_mask_of(mb)
    nll = -out[LOG_PROBS]
    return aggregate_loss(nll, mask, "token-mean", ctx), {
        "target_prob": token_mean_metric(out[LOG_PROBS].exp(), mask, ctx)
    }


def supervised_step(engine: BaseEngine, batch: TensorDict) -> dict[str, float]:
    """One supervised step on ``batch`` (:func:`sft_loss` on its loss mask): forward and
    backward, the optimizer's step, then the LR schedule's. The engine's loss function is put
    back after. Returns ``loss``, ``grad_norm``, ``lr`` (the rate of the next step) and the
    loss's metrics (``target_prob``).

    The schedule steps with every optimizer step here: a supervised step is one step of the
    schedule whichever job takes it. In the SFT job that is the schedule's meaning (its
    ``optim.total_steps`` are the job's steps); in the RL job's warm-up it means the warm-up's
    updates are counted like every later update of the same optimizer, so an LR warm-up
    (``optim.warmup_steps``) ramps over the first updates of the fresh optimizer, the warm-up's,
    instead of holding them all at its first, smallest rate.
    """
    previous = engine.loss_fn
    engine.set_loss_fn(sft_loss)
    try:
        with engine.train_mode():
            result = engine.forward_backward_step(batch)
            grad_norm = engine.optimizer_step()
            engine.optimizer_zero_grad()
            lr = engine.lr_scheduler_step()
    finally:
        engine.set_loss_fn(previous)
    return {"loss": float(result.loss or 0.0), "grad_norm": grad_norm, "lr": lr, **result.metrics}


def supervised_loss(engine: BaseEngine, batches: Iterable[TensorDict]) -> dict[str, float]:
    """:func:`sft_loss` over ``batches`` with no update (the engine in eval mode, no gradients):
    ``loss``, the token-mean negative log-likelihood over every loss token of every batch, and
    ``target_prob``, the token-mean probability of the targets. Each batch weighs by its loss
    tokens, so the result does not depend on how the rows were split into batches."""
    previous = engine.loss_fn
    engine.set_loss_fn(sft_loss)
    nll = prob = 0.0
    tokens = 0
    try:
        with engine.eval_mode():
            for batch in batches:
                n = int(loss_mask_of(batch).sum())
                result = engine.forward_backward_step(batch, forward_only=True)
                nll += float(result.loss or 0.0) * n
                prob += result.metrics["target_prob"] * n
                tokens += n
    finally:
        engine.set_loss_fn(previous)
    if not tokens:
        return {"loss": float("nan"), "target_prob": float("nan")}
    return {"loss": nll / tokens, "target_prob": prob / tokens}
