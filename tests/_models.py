"""Tiny models and batches shared by tests: the conformance kit's, plus test-only helpers."""

from __future__ import annotations

import torch

from engine_core.testing.models import (
    TINY_QWEN2,
    engine_config,
    nll_loss,
    random_batch,
    registered_engine,
    train_steps,
)

__all__ = [
    "TINY_QWEN2",
    "engine_config",
    "flat_grad",
    "nll_loss",
    "random_batch",
    "registered_engine",
    "train_steps",
]


def flat_grad(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
            for p in module.parameters()
        ]
    )


