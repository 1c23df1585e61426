"""Optimizer, LR schedule and gradient-step semantics shared by engines."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from engine_core.config import OptimConfig

__all__ = ["build_optimizer", "build_lr_scheduler", "lr_lambda", "clip_and_step"]


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable ``params``."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters; check model.lora / freezing.")
    return torch.optim.AdamW(
        trainable, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )


def lr_lambda(cfg: OptimConfig, step: int) -> float:
    """Multiplier of the base lr at ``step``: linear warmup, then constant or cosine decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    assert cfg.total_steps is not None  # enforced by OptimConfig
    span = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> LambdaLR:
    """The warmup + constant/cosine schedule as a ``LambdaLR``."""
    return LambdaLR(optimizer, lambda step: lr_lambda(cfg, step))


def clip_and_step(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float | None
) -> tuple[float, bool]:
    """Clip to ``max_norm`` (None: measure only) and step; skip the step on a non-finite norm.

    Returns (global grad norm, whether the update was skipped). Sharded (DTensor) gradients are
    handled by ``clip_grad_norm_``; the norm is materialised as a plain float on every rank.
    """
    norm_t = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
    if hasattr(norm_t, "full_tensor"):
        norm_t = norm_t.full_tensor()
    norm = float(norm_t)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return norm, True
    optimizer.step()
    return norm, False
