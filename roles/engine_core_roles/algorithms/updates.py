"""The update loop every trainable role shares: epochs × mini-batches of forward/backward and
optimizer steps on an engine, one LR step per call, and the metrics of the steps it took
(averaged, with skipped non-finite updates counted and their likely cause warned about).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from tensordict import TensorDict

from engine_core import BaseEngine, LossFn

__all__ = [
    "run_updates",
    "local_mini_batch_size",
    "mean_over_steps",
    "non_finite_inputs",
    "warn_skipped",
]


def run_updates(
    engine: BaseEngine,
    batch: TensorDict,
    loss_fn: LossFn,
    *,
    epochs: int,
    global_mini_batch_size: int | None,
    log_loss: bool,
) -> tuple[list[dict[str, float]], float, TensorDict]:
    """Epochs × mini-batches of forward/backward + optimizer step, then one LR step.

    Returns one metrics dict per optimizer step, the new learning rate, and the per-token
    outputs of the first mini-batch's forward (before any optimizer step).
    """
    n = int(batch.batch_size[0])
    size = local_mini_batch_size(global_mini_batch_size, n, engine.dp_size)
    engine.set_loss_fn(loss_fn)
    history: list[dict[str, float]] = []
    first: TensorDict | None = None
    with engine.train_mode():
        for _ in range(epochs):
            for start in range(0, n, size):
                # the whole batch as it is when one mini-batch holds it (a slice is a new TensorDict)
                part = batch if size == n else batch[start : start + size]
                out = engine.forward_backward_step(part)
                first = out.outputs if first is None else first
                grad_norm = engine.optimizer_step()
                engine.optimizer_zero_grad()
                row = {**out.metrics, "grad_norm": grad_norm}
                if log_loss:
                    row["loss"] = float(out.loss or 0.0)
                history.append(row)
        lr = engine.lr_scheduler_step()
    engine.set_loss_fn(None)
    assert first is not None  # epochs >= 1 and a non-empty batch
    return history, lr, first


def local_mini_batch_size(global_size: int | None, local_samples: int, dp_size: int) -> int:
    """This rank's share of a global mini-batch size (the whole local batch when None)."""
    if global_size is None:
        return local_samples
    if global_size % dp_size:
        raise ValueError(
            f"ppo_mini_batch_size={global_size} does not divide by the DP size {dp_size}; "
            f"use a multiple of {dp_size}."
        )
    size = global_size // dp_size
    if local_samples % size:
        works = [d * dp_size for d in range(1, local_samples + 1) if local_samples % d == 0]
        raise ValueError(
            f"ppo_mini_batch_size={global_size} does not divide this update's "
            f"{local_samples * dp_size} samples ({local_samples} on each of {dp_size} DP ranks): "
            f"the last mini-batch would be smaller, and its samples weigh more. Sizes that work: "
            f"{works}."
        )
    return size


def mean_over_steps(prefix: str, history: list[dict[str, Any]], *, lr: float) -> dict[str, float]:
    """Each metric averaged over the optimizer steps of one update (each step weighs the same).

    ``num_optimizer_steps`` counts the updates applied, ``num_skipped_steps`` those the engine
    skipped because the gradient norm was not finite.
    """
    out = {f"{prefix}/{k}": sum(h[k] for h in history) / len(history) for k in history[0]}
    skipped = sum(not math.isfinite(h["grad_norm"]) for h in history)
    out[f"{prefix}/lr"] = lr
    out[f"{prefix}/num_optimizer_steps"] = float(len(history) - skipped)
    out[f"{prefix}/num_skipped_steps"] = float(skipped)
    return out


def non_finite_inputs(batch: TensorDict) -> list[str]:
    """The floating-point fields of ``batch`` that hold NaN or Inf (the usual cause of a
    skipped update: advantages or returns from a reward that was not finite)."""
    return sorted(
        str(k)
        for k in batch.keys()
        if isinstance(batch.get(k), torch.Tensor)
        and batch[k].is_floating_point()
        and not bool(torch.isfinite(batch[k]).all())
    )


def warn_skipped(role: str, skipped: int, total: int, batch: TensorDict) -> None:
    """Warn (once per cause: Python's warning filter) that updates were skipped, and why."""
    causes = non_finite_inputs(batch)
    cause = (
        f"non-finite values in {causes}"
        if causes
        else "the gradients themselves (no input field is non-finite: a loss that overflows?)"
    )
    warnings.warn(
        f"{role}: {skipped} of {total} optimizer steps skipped (non-finite gradient norm); "
        f"cause: {cause}.",
        RuntimeWarning,
        stacklevel=3,
    )
