"""Driving an engine through its public API (``BaseEngine``) the way the kit's checks do:
build it from a config (capability checks included), forward a batch, run training steps, read
its weights, and record what a call raised.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from tensordict import TensorDict

from engine_core.batch import LOG_PROBS
from engine_core.capabilities import Capability
from engine_core.engine import BaseEngine
from engine_core.plugins import load_plugins
from engine_core.resolve import resolve_engine_config
from engine_core.testing.models import TINY_QWEN2, engine_config, nll_loss
from engine_core.testing.oracle import UPDATE_STEPS, eval_batch, masked_batch, train_batch
from engine_core.testing.vision import TINY_QWEN2_5_VL

__all__ = [
    "CAPABILITY_TRIGGERS",
    "LORA",
    "build",
    "declared_capabilities",
    "fingerprint",
    "first_step",
    "forward",
    "oracle_steps",
    "outputs",
    "params",
    "raised_by",
    "rng_draws",
    "skip_a_step",
    "step",
    "train",
    "train_lrs",
]

LORA = {"rank": 4, "alpha": 8.0}

# the config that asks a backend for a capability (refused at resolution when undeclared)
CAPABILITY_TRIGGERS: dict[Capability, dict[str, Any]] = {
    Capability.VALUE_HEAD: {"model": {"config": dict(TINY_QWEN2), "value_head": True}},
    Capability.LORA: {"model": {"config": dict(TINY_QWEN2), "lora": LORA}},
    Capability.GRADIENT_CHECKPOINTING: {
        "model": {"config": dict(TINY_QWEN2), "gradient_checkpointing": True}
    },
    Capability.TENSOR_PARALLEL: {"tensor_parallel_size": 2},
    Capability.PIPELINE_PARALLEL: {"pipeline_parallel_size": 2},
    Capability.CONTEXT_PARALLEL: {"context_parallel_size": 2},
    Capability.PACKING: {"use_packing": True},
    Capability.DYNAMIC_BATCH: {"max_tokens_per_micro_batch": 64},
    Capability.OFFLOAD: {"offload": True},
    Capability.BF16: {"model": {"config": dict(TINY_QWEN2), "dtype": "bfloat16"}},
    Capability.MIXED_PRECISION: {"compute_dtype": "bfloat16"},
    Capability.ACTIVATION_OFFLOAD: {"activation_offload": True},
    Capability.VISION: {"model": {"config": dict(TINY_QWEN2_5_VL)}},
}


def declared_capabilities(backend: str) -> frozenset[Capability]:
    return frozenset(load_plugins().get_engine(backend).capabilities)


def _packing(backend: str) -> bool:
    return Capability.PACKING in declared_capabilities(backend)


def build(backend: str, **overrides: Any) -> BaseEngine:
    """Resolve (capability checks included), construct and initialise ``backend``'s engine."""
    overrides.setdefault("use_packing", _packing(backend))
    raw = engine_config(backend=backend, **overrides)
    spec, cfg = resolve_engine_config(raw, load_plugins())
    engine: BaseEngine = spec.load_class()(cfg)
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    return engine


def forward(engine: BaseEngine, batch: TensorDict) -> dict[str, torch.Tensor]:
    """Forward-only outputs of the global ``batch`` (sharded over DP, gathered back)."""
    engine.set_loss_fn(None)
    with engine.eval_mode():
        out = engine.forward_backward_step(engine.shard_data(batch), forward_only=True).outputs
    engine.set_loss_fn(nll_loss)
    gathered = engine.unshard_data(out)
    return {str(k): cast(torch.Tensor, gathered[k]) for k in gathered.keys()}


def first_step(engine: BaseEngine, batch: TensorDict) -> dict[str, Any]:
    """Loss, grad norm and micro-batch count of one optimizer step (no clipping)."""
    calls: list[int] = []

    def counting_loss(mb: TensorDict, out: TensorDict, ctx: Any) -> Any:
        calls.append(ctx.num_micro_batches)
        return nll_loss(mb, out, ctx)

    engine.set_loss_fn(counting_loss)
    with engine.train_mode():
        result = engine.forward_backward_step(engine.shard_data(batch))
        norm = engine.optimizer_step()
        engine.lr_scheduler_step()
        engine.optimizer_zero_grad()
    engine.set_loss_fn(nll_loss)
    return {
        "loss": result.loss,
        "norm": norm,
        "calls": len(calls),
        "declared": calls[:1],
        "metrics": dict(result.metrics),
    }


def outputs(backend: str, **overrides: Any) -> dict[str, torch.Tensor]:
    return forward(build(backend, **overrides), eval_batch())


def step(
    backend: str, overrides: dict[str, Any], batch: TensorDict | None = None
) -> dict[str, Any]:
    return first_step(build(backend, **overrides), train_batch() if batch is None else batch)


def train(engine: BaseEngine, seeds: range) -> list[tuple[float | None, float]]:
    return [(loss, norm) for loss, norm, _ in train_lrs(engine, seeds)]


def params(engine: BaseEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.named_full_params()}


def oracle_steps(engine: BaseEngine) -> None:
    """The update oracle's :data:`UPDATE_STEPS` training steps, on the engine: the same
    batches, each sharded over its DP ranks."""
    for i in range(UPDATE_STEPS):
        with engine.train_mode():
            engine.forward_backward_step(engine.shard_data(masked_batch(i)))
            engine.optimizer_step()
            engine.lr_scheduler_step()
            engine.optimizer_zero_grad()


def rng_draws() -> list[float]:
    """A few values from every stream a resume must continue (torch, numpy, Python)."""
    import random

    import numpy as np

    return [*torch.rand(3).tolist(), *np.random.rand(2).tolist(), random.random()]


def fingerprint(engine: BaseEngine) -> float:
    return float(sum(float(t.double().abs().sum()) for _, t in engine.named_full_params()))


def train_lrs(engine: BaseEngine, seeds: range) -> list[tuple[float | None, float, float]]:
    out = []
    for s in seeds:
        with engine.train_mode():
            result = engine.forward_backward_step(engine.shard_data(train_batch(s)))
            norm = engine.optimizer_step()
            lr = engine.lr_scheduler_step()
            engine.optimizer_zero_grad()
        out.append((result.loss, norm, lr))
    return out


def skip_a_step(engine: BaseEngine, seed: int = 9) -> float:
    """One step whose gradient norm is NaN (which the optimizer must skip, and count); the
    norm ``optimizer_step()`` returned."""
    engine.set_loss_fn(lambda mb, out, ctx: ((out[LOG_PROBS] * math.nan).sum(), {}))
    with engine.train_mode():
        engine.forward_backward_step(engine.shard_data(train_batch(seed)))
        norm = engine.optimizer_step()
        engine.optimizer_zero_grad()
    engine.set_loss_fn(nll_loss)
    return norm


def raised_by(call: Callable[[], Any]) -> dict[str, Any] | None:
    """What ``call`` raised: the names of the exception's class and its bases, and its
    message; None when it returned."""
    try:
        call()
    except Exception as e:  # the clause says which exception it wanted
        return {"types": [c.__name__ for c in type(e).__mro__], "message": str(e)}
    return None
