"""The conformance kit's face: the entry points each of the kit's processes runs (one per
layout), and the helpers other tests reuse (building and driving an engine, the oracle).

Every check drives a registered engine through its public API only (``BaseEngine``) on a tiny
Qwen2 model, and compares with plain transformers on the same weights. One process run per
layout gathers the raw results of every check the engine's declared capabilities select
(:data:`engine_core.testing.checks.REGISTRY`; an exception in one check is recorded, not
fatal), so the contract tests beside each check stay cheap and each fails with its own message.
"""

from __future__ import annotations

from typing import Any

from engine_core.testing.checks import REGISTRY, Layout
from engine_core.testing.checks.registry import context_of
from engine_core.testing.drive import (
    CAPABILITY_TRIGGERS,
    build,
    declared_capabilities,
    first_step,
    forward,
)
from engine_core.testing.oracle import (
    MIXED_PRECISION_OPTIM,
    UPDATE_CAUSES,
    UPDATE_OPTIM,
    UPDATE_STEPS,
    Baseline,
    eval_batch,
    make_baseline,
    masked_batch,
    plain_log_probs,
    plain_loss_and_grad_norm,
    plain_update,
    plain_values,
    train_batch,
)

__all__ = [
    "Baseline",
    "CAPABILITY_TRIGGERS",
    "build",
    "declared_capabilities",
    "eval_batch",
    "first_step",
    "forward",
    "make_baseline",
    "plain_log_probs",
    "plain_values",
    "plain_loss_and_grad_norm",
    "plain_update",
    "masked_batch",
    "train_batch",
    "UPDATE_OPTIM",
    "UPDATE_STEPS",
    "UPDATE_CAUSES",
    "MIXED_PRECISION_OPTIM",
    "no_process_group_checks",
    "run_checks",
    "single_process_checks",
    "two_process_checks",
]


def run_checks(layout: Layout, backend: str, baseline: dict[str, str]) -> dict[str, Any]:
    """Every check of ``layout`` that ``backend``'s declared capabilities select (only those
    named by the kit's ``--engine-core-kit-only`` prefixes, ``baseline["only"]``): their raw
    results by check name."""
    only = tuple(p for p in baseline.get("only", "").split(",") if p)
    caps = declared_capabilities(backend)
    return REGISTRY.run_layout(layout, context_of(backend, caps, baseline), only)


def single_process_checks(
    rank: int, world: int, backend: str, baseline: dict[str, str]
) -> dict[str, Any]:
    """Every single-process check; runs inside a one-rank process group."""
    return run_checks(Layout.SINGLE, backend, baseline)


def two_process_checks(
    rank: int, world: int, backend: str, baseline: dict[str, str]
) -> dict[str, Any]:
    """Data-parallel checks on two ranks (one DP rank each)."""
    return run_checks(Layout.TWO, backend, baseline)


def no_process_group_checks(
    rank: int, world: int, backend: str, baseline: dict[str, str]
) -> dict[str, Any]:
    """The engine as a script or ``engine-core run`` uses it: one plain process, no process
    group beforehand."""
    return run_checks(Layout.PLAIN, backend, baseline)
