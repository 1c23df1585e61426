"""Outputs: forward-only log-probs, entropy and values against plain transformers, padded and
packed, chunked and with full logits, on one and two DP ranks and each declared model-parallel
layout; a value head read at each token.
"""

from __future__ import annotations

import pytest
import torch

from engine_core.batch import ENTROPY, LOG_PROBS, VALUES, with_meta
from engine_core.capabilities import Capability
from engine_core.testing.checks.registry import Check, Context, Layout
from engine_core.testing.checks.verdict import ATOL, assert_outputs, result
from engine_core.testing.drive import build, forward, outputs
from engine_core.testing.oracle import Baseline, eval_batch

__all__ = [
    "CHECKS",
    "test_log_probs_and_entropy_match_transformers",
    "test_model_parallel_outputs_match_transformers",
    "test_outputs_with_two_dp_ranks_match_transformers",
    "test_values_at_token_read_the_head_at_each_token",
    "test_values_match_transformers",
]


def _padded_or_packed(packing: bool) -> Check:
    return Check(
        f"outputs_packing={packing}",
        Layout.SINGLE,
        lambda c: outputs(c.backend, model=c.policy, use_packing=packing, micro_batch_size=3),
        needs=frozenset({Capability.PACKING}) if packing else frozenset(),
    )


PADDED, PACKED = _padded_or_packed(False), _padded_or_packed(True)
# the output layer's plain forward (full logits) as well as the default chunked head
FULL_LOGITS = Check(
    "outputs_full_logits",
    Layout.SINGLE,
    lambda c: outputs(c.backend, model=c.policy, micro_batch_size=3, logits_chunk_tokens=None),
)
VALUE_OUTPUTS = Check(
    "values",
    Layout.SINGLE,
    lambda c: outputs(c.backend, model=c.critic, micro_batch_size=3),
    needs=frozenset({Capability.VALUE_HEAD}),
)


def _values_at_token(c: Context) -> torch.Tensor:
    engine = build(c.backend, model=c.critic, micro_batch_size=3)
    return forward(engine, with_meta(eval_batch(), values_at_token=True))[VALUES]


AT_TOKEN = Check(
    "at_token", Layout.SINGLE, _values_at_token, needs=frozenset({Capability.VALUE_HEAD})
)
TWO_RANKS = Check(
    "outputs", Layout.TWO, lambda c: outputs(c.backend, model=c.policy, micro_batch_size=3)
)


def _model_parallel(cap: Capability, field_name: str) -> Check:
    return Check(
        f"outputs_{cap}",
        Layout.TWO,
        lambda c: outputs(c.backend, model=c.policy, micro_batch_size=3, **{field_name: 2}),
        needs=frozenset({cap}),
    )


MODEL_PARALLEL = {
    cap: _model_parallel(cap, field_name)
    for cap, field_name in (
        (Capability.TENSOR_PARALLEL, "tensor_parallel_size"),
        (Capability.PIPELINE_PARALLEL, "pipeline_parallel_size"),
        (Capability.CONTEXT_PARALLEL, "context_parallel_size"),
    )
}

CHECKS = (PADDED, PACKED, FULL_LOGITS, VALUE_OUTPUTS, AT_TOKEN, TWO_RANKS, *MODEL_PARALLEL.values())


def test_log_probs_and_entropy_match_transformers(
    single: dict, caps: frozenset, kit_baseline: Baseline
) -> None:
    for check in (c for c in (PADDED, PACKED) if c.applies(caps)):
        out = result(single, check, "outputs")
        layout = "packed" if check is PACKED else "padded"
        assert_outputs(out[LOG_PROBS], kit_baseline.log_probs, "log_probs", layout)
        assert_outputs(out[ENTROPY], kit_baseline.entropy, "entropy", layout)
    out = result(single, FULL_LOGITS, "outputs")
    assert_outputs(out[LOG_PROBS], kit_baseline.log_probs, "log_probs", "full logits")
    assert_outputs(out[ENTROPY], kit_baseline.entropy, "entropy", "full logits")


def test_values_match_transformers(single: dict, caps: frozenset, kit_baseline: Baseline) -> None:
    if not VALUE_OUTPUTS.applies(caps):
        pytest.skip("value_head not declared")
    assert_outputs(
        result(single, VALUE_OUTPUTS, "values")[VALUES], kit_baseline.values, "values", "1 rank"
    )


def test_outputs_with_two_dp_ranks_match_transformers(double: list, kit_baseline: Baseline) -> None:
    for rank, r in enumerate(double):
        out = result(r, TWO_RANKS, "outputs")
        assert_outputs(out[LOG_PROBS], kit_baseline.log_probs, "log_probs", f"dp=2, rank {rank}")


def test_model_parallel_outputs_match_transformers(
    double: list, caps: frozenset, kit_baseline: Baseline
) -> None:
    declared = [(cap, check) for cap, check in MODEL_PARALLEL.items() if check.applies(caps)]
    if not declared:
        pytest.skip("no model parallelism declared")
    for cap, check in declared:
        for rank, r in enumerate(double):
            out = result(r, check, str(cap))
            assert_outputs(
                out[LOG_PROBS], kit_baseline.log_probs, "log_probs", f"{cap}=2, rank {rank}"
            )


def test_values_at_token_read_the_head_at_each_token(
    single: dict, caps: frozenset, kit_baseline: Baseline
) -> None:
    if not AT_TOKEN.applies(caps):
        pytest.skip("value_head not declared")
    got = result(single, AT_TOKEN, "values at token")
    want = kit_baseline.values_at_token
    if got.shape == want.shape and torch.allclose(got, want, atol=ATOL):
        return
    shifted = got.shape == want.shape and torch.allclose(got, kit_baseline.values, atol=ATOL)
    diff = float((got - want).abs().max()) if got.shape == want.shape else float("nan")
    hint = (
        "they are the default values (each token's prefix before it): read the head at each "
        "token itself, unshifted, when values_at_token is set"
        if shifted
        else "read the value head's output at every real token, unshifted; padding holds 0"
    )
    pytest.fail(
        f"[values at token] values with BatchMeta(values_at_token=True), shape "
        f"{tuple(got.shape)}, differ from the value head's output at each token by {diff:.3g} "
        f"(atol {ATOL}): {hint} (BaseEngine.prepare_model_outputs does)."
    )
