"""The loss and metric contract: global normalization and declared reductions."""

from __future__ import annotations

import pytest
import torch

from engine_core.loss import (
    GlobalBatchContext,
    LossAggregation,
    Metric,
    MetricAccumulator,
    aggregate_loss,
    token_mean_metric,
)

VALUES = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0], [6.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])


def ctx(tokens: int = 6, samples: int = 3) -> GlobalBatchContext:
    return GlobalBatchContext(global_num_tokens=tokens, global_num_samples=samples)


def test_token_mean_by_hand() -> None:
    assert float(aggregate_loss(VALUES, MASK, "token-mean", ctx())) == pytest.approx(21 / 6)


def test_seq_mean_token_mean_by_hand() -> None:
    want = (6 / 3 + 9 / 2 + 6 / 1) / 3
    got = aggregate_loss(VALUES, MASK, LossAggregation.SEQ_MEAN_TOKEN_MEAN, ctx())
    assert float(got) == pytest.approx(want)


def test_seq_mean_token_sum_by_hand() -> None:
    got = aggregate_loss(VALUES, MASK, LossAggregation.SEQ_MEAN_TOKEN_SUM, ctx())
    assert float(got) == pytest.approx((6 + 9 + 6) / 3)


@pytest.mark.parametrize("mode", list(LossAggregation))
def test_split_sums_to_whole(mode: LossAggregation) -> None:
    """Any partition of the samples into micro-batches sums to the whole-batch value."""
    norm = {"norm_length": 4}  # seq-mean-token-sum-norm's constant; ignored by the others
    whole = aggregate_loss(VALUES, MASK, mode, ctx(), **norm)
    parts = [
        aggregate_loss(VALUES[i : i + 1], MASK[i : i + 1], mode, ctx(), **norm) for i in range(3)
    ]
    assert float(sum(parts)) == pytest.approx(float(whole))


def test_seq_mean_token_sum_norm_divides_by_one_constant() -> None:
    got = aggregate_loss(VALUES, MASK, "seq-mean-token-sum-norm", ctx(), norm_length=4)
    assert float(got) == pytest.approx((6 + 9 + 6) / 4 / 3)
    with pytest.raises(ValueError, match="norm_length >= 1"):
        aggregate_loss(VALUES, MASK, "seq-mean-token-sum-norm", ctx())


def test_masked_values_are_ignored() -> None:
    noisy = VALUES.masked_fill(~MASK.bool(), 1e6)
    assert float(aggregate_loss(noisy, MASK, "token-mean", ctx())) == pytest.approx(21 / 6)


def test_unknown_aggregation_is_refused() -> None:
    with pytest.raises(ValueError, match="token-sum"):
        aggregate_loss(VALUES, MASK, "token-sum", ctx())


def test_metric_reductions() -> None:
    acc = MetricAccumulator()
    for v in (1.0, 2.0, 6.0):
        acc.add("s", Metric(v, "sum"))
        acc.add("m", Metric(v, "mean"))
        acc.add("lo", Metric(v, "min"))
        acc.add("hi", Metric(v, "max"))
    assert acc.reduce() == {"s": 9.0, "m": 3.0, "lo": 1.0, "hi": 6.0}


def test_metric_reduction_declared_once() -> None:
    acc = MetricAccumulator()
    acc.add("x", Metric(1.0, "sum"))
    with pytest.raises(ValueError, match="declared with reduction sum"):
        acc.add("x", Metric(1.0, "mean"))


def test_token_mean_metric_is_micro_batch_invariant() -> None:
    acc = MetricAccumulator()
    for i in range(3):
        acc.add("v", token_mean_metric(VALUES[i : i + 1], MASK[i : i + 1], ctx()))
    assert acc.reduce()["v"] == pytest.approx(21 / 6)
