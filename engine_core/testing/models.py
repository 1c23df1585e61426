"""Tiny models, batches and a loss for tests and the conformance kit (built from configs:
nothing is downloaded)."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from engine_core.batch import make_batch

__all__ = [
    "TINY_QWEN2",
    "TINY_QWEN3",
    "engine_config",
    "random_batch",
    "nll_loss",
    "registered_engine",
    "save_with_own_norms",
    "train_steps",
]
from engine_core.loss import GlobalBatchContext, Metric, aggregate_loss, token_mean_metric

TINY_QWEN2: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


# a Qwen3 of odd shapes: vocabulary 67, head_dim 16 apart from hidden 48 / 4 heads, per-head
# q/k RMSNorms
TINY_QWEN3: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 67,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def engine_config(**overrides: Any) -> dict[str, Any]:
    """Raw config dict for the reference engine on the tiny model."""
    cfg: dict[str, Any] = {
        "backend": "reference",
        "model": {"config": dict(TINY_QWEN2)},
        "optim": {"lr": 1e-2, "clip_grad": None},
        "seed": 0,
    }
    cfg.update(overrides)
    return cfg


def random_batch(
    num_samples: int, seq_len: int = 24, *, seed: int = 0, left_pad: bool = False, min_len: int = 3
) -> TensorDict:
    """Random token ids with random lengths, padded to ``seq_len``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, seq_len + 1, (num_samples,), generator=g)
    ids = torch.randint(1, TINY_QWEN2["vocab_size"], (num_samples, seq_len), generator=g)
    pos = torch.arange(seq_len).expand(num_samples, seq_len)
    if left_pad:
        mask = pos >= (seq_len - lengths).unsqueeze(1)
    else:
        mask = pos < lengths.unsqueeze(1)
    ids = ids.masked_fill(~mask, 0)
    return make_batch(ids, mask.long())


def nll_loss(
    mb: TensorDict, out: TensorDict, ctx: GlobalBatchContext
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Token-mean negative log-likelihood over the default loss mask."""
    from engine_core.engine import loss_mask_of

    mask = loss_mask_of(mb)
    loss = aggregate_loss(-out["log_probs"], mask, "token-mean", ctx)
    return loss, {"nll": token_mean_metric(-out["log_probs"], mask, ctx)}


def registered_engine(backend: str, **overrides: Any) -> Any:
    """An initialised engine of a registered backend on the tiny model, NLL loss set."""
    from engine_core.plugins import load_plugins

    spec = load_plugins().get_engine(backend)
    config = spec.load_config_class()(**engine_config(backend=backend, **overrides))
    engine = spec.load_class()(config)
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    return engine


def train_steps(engine: Any, steps: range, num_samples: int = 8) -> list[tuple[float, float]]:
    """(loss, grad norm) of one optimizer step per seed in ``steps``."""
    out = []
    for s in steps:
        with engine.train_mode():
            result = engine.forward_backward_step(
                engine.shard_data(random_batch(num_samples, seed=s))
            )
            norm = engine.optimizer_step()
            engine.lr_scheduler_step()
            engine.optimizer_zero_grad()
        out.append((result.loss, norm))
    return out


def save_with_own_norms(config: dict[str, Any], path: Any) -> None:
    """Build the model of ``config`` (seed 0) with every norm weight its own random value (they
    are ones at init, so a swapped or dropped norm would not show) and ``save_pretrained`` it to
    ``path``."""
    from engine_core.config import ModelConfig
    from engine_core.models import build_model

    torch.manual_seed(0)
    model: Any = build_model(ModelConfig(config=dict(config)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
