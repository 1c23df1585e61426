"""Gradients and the loss: one step's loss and grad norm against the full batch's for every
micro-batching (sizes, a token budget, chunked and full logits, activation checkpointing,
context parallelism) on one and two DP ranks, the loss function's metrics reduced, micro-batch
counts agreed across DP ranks, and what activation checkpointing and activation offload do.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict

from engine_core.batch import ATTENTION_MASK, INPUT_IDS, make_batch
from engine_core.capabilities import Capability
from engine_core.testing.checks.registry import Check, Context, Layout
from engine_core.testing.checks.verdict import RTOL, check_step, result
from engine_core.testing.drive import build, first_step, step
from engine_core.testing.models import random_batch
from engine_core.testing.oracle import Baseline, N, train_batch

__all__ = [
    "CHECKS",
    "test_activation_offload_takes_the_models_saved_tensors",
    "test_gradient_checkpointing_recomputes_the_blocks",
    "test_gradient_invariance_single_process",
    "test_gradient_invariance_two_dp_ranks",
    "test_metrics_reduce_over_micro_batches_and_ranks",
    "test_micro_batch_counts_agree_across_dp_ranks",
]

STEP_OPTIM = {"lr": 1e-3, "clip_grad": None}


def _step_check(
    layout: Layout, name: str, overrides: dict[str, Any], needs: frozenset[Capability] = frozenset()
) -> Check:
    """One optimizer step of ``build(model=policy, **overrides)`` on the kit's training batch."""
    return Check(
        f"step_{name}",
        layout,
        lambda c: step(c.backend, {"model": c.policy, "optim": dict(STEP_OPTIM), **overrides}),
        needs=needs,
    )


def _checkpointing_step(c: Context) -> dict[str, Any]:
    overrides = {"model": {**c.policy, "gradient_checkpointing": True}}
    return step(c.backend, {"model": c.policy, "optim": dict(STEP_OPTIM), **overrides})


DYNAMIC = frozenset({Capability.DYNAMIC_BATCH})
SINGLE_STEPS = (
    _step_check(Layout.SINGLE, "mbs1", {"micro_batch_size": 1}),
    _step_check(Layout.SINGLE, "mbs3", {"micro_batch_size": 3}),
    # chunks of 3 tokens cross sequence boundaries; null: full logits
    _step_check(
        Layout.SINGLE, "chunks_of_3_tokens", {"micro_batch_size": 3, "logits_chunk_tokens": 3}
    ),
    _step_check(Layout.SINGLE, "full_logits", {"micro_batch_size": 3, "logits_chunk_tokens": None}),
    _step_check(Layout.SINGLE, "budget40", {"max_tokens_per_micro_batch": 40}, DYNAMIC),
    Check(
        "step_checkpointing",
        Layout.SINGLE,
        _checkpointing_step,
        needs=frozenset({Capability.GRADIENT_CHECKPOINTING}),
    ),
)
CP2 = _step_check(  # each row split over both ranks: one DP rank
    Layout.TWO,
    "cp2",
    {"micro_batch_size": 3, "context_parallel_size": 2},
    frozenset({Capability.CONTEXT_PARALLEL}),
)
TWO_STEPS = (
    _step_check(Layout.TWO, "mbs2", {"micro_batch_size": 2}),
    _step_check(Layout.TWO, "budget40", {"max_tokens_per_micro_batch": 40}, DYNAMIC),
    CP2,
)


def _uneven_batch() -> TensorDict:
    """Long sequences first, short ones last: DP rank 0 needs more budget micro-batches."""
    long = random_batch(N // 2, seed=5, min_len=20)
    short = random_batch(N // 2, seed=6, min_len=3, seq_len=6)
    pad = torch.zeros(
        N // 2, long[INPUT_IDS].shape[1] - short[INPUT_IDS].shape[1], dtype=torch.long
    )
    ids = torch.cat([long[INPUT_IDS], torch.cat([short[INPUT_IDS], pad], 1)])
    mask = torch.cat([long[ATTENTION_MASK], torch.cat([short[ATTENTION_MASK], pad], 1)])
    return make_batch(ids, mask)


UNEVEN_COUNTS = Check(
    "uneven_counts",
    Layout.TWO,
    lambda c: step(
        c.backend, {"model": c.policy, "max_tokens_per_micro_batch": 48}, _uneven_batch()
    ),
    needs=DYNAMIC,
)


def _block_calls(c: Context, checkpointing: bool) -> int:
    """Forward calls of the model's decoder blocks (modules whose class name ends in
    ``DecoderLayer`` or ``TransformerLayer``) during one training step: activation
    checkpointing runs each block's forward again in the backward."""
    engine = build(c.backend, model={**c.policy, "gradient_checkpointing": checkpointing})
    module = engine.module
    assert module is not None
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    hooks = [
        # a pre-hook: a recomputation may stop early, before a forward hook would run
        m.register_forward_pre_hook(count)
        for m in module.modules()
        if type(m).__name__.endswith(("DecoderLayer", "TransformerLayer"))
    ]
    first_step(engine, train_batch())
    for h in hooks:
        h.remove()
    return calls[0] if hooks else -1


RECOMPUTE = Check(
    "recompute",
    Layout.SINGLE,
    lambda c: {on: _block_calls(c, on) for on in (False, True)},
    needs=frozenset({Capability.GRADIENT_CHECKPOINTING}),
)


def _saved_tensors(c: Context) -> dict[str, Any]:
    """One training step with ``activation_offload``, under saved-tensor hooks of the caller's:
    how many tensors saved inside the model's forward reached them (the engine's own hooks,
    entered around the model, must take every one), and the step's loss and grad norm."""
    engine = build(
        c.backend, model=c.policy, activation_offload=True, optim={"lr": 1e-3, "clip_grad": None}
    )
    module = engine.module
    assert module is not None
    inside, reached = [False], [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        reached[0] += inside[0]
        return t

    def enter(*_: Any) -> None:
        inside[0] = True

    def leave(*_: Any) -> None:
        inside[0] = False

    hooks = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        done = first_step(engine, train_batch())
    for h in hooks:
        h.remove()
    return {"reached": reached[0], "step": done}


SAVED_TENSORS = Check(
    "saved_tensors",
    Layout.SINGLE,
    _saved_tensors,
    needs=frozenset({Capability.ACTIVATION_OFFLOAD}),
)

CHECKS = (*SINGLE_STEPS, RECOMPUTE, SAVED_TENSORS, *TWO_STEPS, UNEVEN_COUNTS)


def _ran(results: dict[str, Any], steps: tuple[Check, ...]) -> list[Check]:
    return [c for c in steps if c.name in results]


def test_gradient_invariance_single_process(single: dict, kit_baseline: Baseline) -> None:
    steps = _ran(single, SINGLE_STEPS)
    assert steps, "no gradient checks ran"
    for c in steps:
        check_step(result(single, c, "gradient invariance"), kit_baseline, f"1 rank, {c.name[5:]}")


def test_gradient_invariance_two_dp_ranks(double: list, kit_baseline: Baseline) -> None:
    for rank, r in enumerate(double):
        for c in _ran(r, TWO_STEPS):
            got = result(r, c, "gradient invariance")
            dp = 1 if c is CP2 else 2  # context parallel: both ranks share one row
            check_step(got, kit_baseline, f"dp={dp} rank {rank}, {c.name[5:]}", dp_size=dp)


def _check_metrics(step: dict, baseline: Baseline, variant: str) -> None:
    got = step["metrics"].get("nll")
    if got is None:
        pytest.fail(
            f"[metric reduction] {variant}: the loss function's metric 'nll' is missing from "
            f"forward_backward_step().metrics ({sorted(step['metrics'])}): every micro-batch's "
            f"metrics must be accumulated and reduced (MetricAccumulator)."
        )
    if abs(got - baseline.loss) > RTOL * abs(baseline.loss):
        pytest.fail(
            f"[metric reduction] {variant}: the token-mean metric 'nll' reduced to {got:.8g}, "
            f"the full-batch value is {baseline.loss:.8g} ({got / baseline.loss:.4g}x). Every "
            f"micro-batch's metrics must be accumulated (not only the last one's) and reduced "
            f"across DP ranks by their declared reduction (MetricAccumulator.reduce)."
        )


def test_metrics_reduce_over_micro_batches_and_ranks(
    single: dict, double: list, kit_baseline: Baseline
) -> None:
    for c in _ran(single, SINGLE_STEPS):
        _check_metrics(result(single, c, "metric reduction"), kit_baseline, f"1 rank, {c.name[5:]}")
    for rank, r in enumerate(double):
        for c in _ran(r, TWO_STEPS):
            got = result(r, c, "metric reduction")
            _check_metrics(got, kit_baseline, f"dp=2 rank {rank}, {c.name[5:]}")


def test_micro_batch_counts_agree_across_dp_ranks(double: list, caps: frozenset) -> None:
    if not UNEVEN_COUNTS.applies(caps):
        pytest.skip("dynamic_batch not declared")
    counts = [result(r, UNEVEN_COUNTS, "micro-batch agreement")["calls"] for r in double]
    if len(set(counts)) != 1:
        pytest.fail(
            f"[micro-batch agreement] DP ranks ran {counts} micro-batches on a token budget: "
            f"every rank must run the same count (agree on the max across the DP group), or "
            f"collectives inside forward/backward deadlock."
        )


def test_gradient_checkpointing_recomputes_the_blocks(single: dict, caps: frozenset) -> None:
    if not RECOMPUTE.applies(caps):
        pytest.skip("gradient_checkpointing not declared")
    calls = result(single, RECOMPUTE, "gradient checkpointing")
    off, on = calls[False], calls[True]
    if off < 0:
        pytest.fail(
            "[gradient checkpointing] no module of the model has a class name ending in "
            "DecoderLayer or TransformerLayer, so the kit cannot count the blocks' forwards."
        )
    assert on > off, (
        f"[gradient checkpointing] one training step ran the decoder blocks' forward {on} "
        f"times with model.gradient_checkpointing=true and {off} times without: nothing is "
        f"recomputed in the backward, so the option saves no memory. Enable activation "
        f"checkpointing on the blocks (transformers: gradient_checkpointing_enable())."
    )


def test_activation_offload_takes_the_models_saved_tensors(
    single: dict, caps: frozenset, kit_baseline: Baseline
) -> None:
    if not SAVED_TENSORS.applies(caps):
        pytest.skip("activation_offload not declared")
    got = result(single, SAVED_TENSORS, "activation offload")
    if got["reached"]:
        pytest.fail(
            f"[activation offload] with activation_offload: true, {got['reached']} tensors the "
            f"model's forward saved for the backward reached saved-tensor hooks entered around "
            f"the step, not the engine's own: run the model inside the engine's "
            f"OffloadActivations (BaseEngine.forward_model does)."
        )
    check_step(got["step"], kit_baseline, "activation offload")
