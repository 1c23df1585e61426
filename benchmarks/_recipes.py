"""Inputs and timing shared by the benchmarks, so every script measures the same way."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["lengths_recipe", "timed"]


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
