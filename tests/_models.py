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
    "save_reward_model",
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


def save_reward_model(folder: object, model_config: dict, *, seed: int = 0) -> None:
    """A sequence-classification model (one label) of ``model_config``'s architecture, random
    weights from ``seed``, saved with ``save_pretrained``: a reward model to load by path."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = dict(model_config)
    hf = AutoConfig.for_model(cfg.pop("model_type"), num_labels=1, pad_token_id=0, **cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForSequenceClassification.from_config(hf).save_pretrained(str(folder))
