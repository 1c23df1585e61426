"""Inputs shared by the benchmarks, so every script measures the same long-tailed lengths."""

from __future__ import annotations

import numpy as np

__all__ = ["lengths_recipe"]


def lengths_recipe(n: int) -> np.ndarray:
    """``clip(rint(lognormal(6.5, 1.0, n)), 16, 8192)`` from ``default_rng(0)``, as ints."""
    rng = np.random.default_rng(0)
    return np.clip(np.rint(rng.lognormal(mean=6.5, sigma=1.0, size=n)), 16, 8192).astype(int)
