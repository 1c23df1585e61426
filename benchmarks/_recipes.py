"""Inputs and timing shared by the benchmarks, so every script measures the same way."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["build_engine", "lengths_recipe", "nll", "timed", "train_step"]


def lengths_recipe(n: int) -> np.ndarray:
    """``clip(rint(lognormal(6.5, 1.0, n)), 16, 8192)`` from ``default_rng(0)``, as ints."""
    rng = np.random.default_rng(0)
    return np.clip(np.rint(rng.lognormal(mean=6.5, sigma=1.0, size=n)), 16, 8192).astype(int)


def timed(
    fn: Callable[..., Any], *args: Any, repeats: int, warmup: bool = True
) -> tuple[Any, float]:
    """Run ``fn(*args)`` ``repeats`` times (after one untimed warm-up); (last result, median ms)."""
    if warmup:
        fn(*args)
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return result, statistics.median(times)


def nll(mb: Any, out: Any, ctx: Any) -> tuple[Any, dict[str, Any]]:
    """Token-mean NLL of the log-probs, with no metrics (no reductions beyond the loss's)."""
    from engine_core.engine import loss_mask_of
    from engine_core.loss import aggregate_loss

    return aggregate_loss(-out["log_probs"], loss_mask_of(mb), "token-mean", ctx), {}


def build_engine(raw: dict[str, Any]) -> Any:
    """An engine resolved from the raw config through the installed plugins, built, with
    :func:`nll` as its loss: every engine the same way, as a user's script builds it."""
    from engine_core.plugins import load_plugins
    from engine_core.resolve import resolve_engine_config

    spec, cfg = resolve_engine_config(raw, load_plugins())
    engine = spec.load_class()(cfg)
    engine.init_model()
    engine.set_loss_fn(nll)
    return engine


def train_step(engine: Any, batch: Any) -> Any:
    """One optimizer step on this rank's ``batch``; the forward-backward result."""
    with engine.train_mode():
        result = engine.forward_backward_step(batch)
        engine.optimizer_step()
        engine.lr_scheduler_step()
        engine.optimizer_zero_grad()
    return result
