"""The loss and metric contract.

A loss function receives a micro-batch, the model outputs for it, and a
:class:`GlobalBatchContext` with token and sample counts summed over *all* micro-batches and
data-parallel ranks. Losses normalized by those global counts make the gradient of a
mini-batch the plain sum of per-micro-batch, per-rank gradients, so it does not depend on the
micro-batch size, the token budget or the DP size. Engines therefore sum gradients over
micro-batches and ranks and never rescale them.

Metrics declare their reduction once (:class:`Reduction`). A value normalized by global counts
(``token_mean_metric``) uses ``SUM`` and is invariant like the loss; ``MEAN`` averages the
values added (one per micro-batch and rank) and is meant for per-step scalars.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from tensordict import TensorDict

from engine_core.capabilities import StrEnum
from engine_core.comm import all_gather_bytes, all_reduce_cpu

__all__ = [
    "GlobalBatchContext",
    "LossAggregation",
    "aggregate_loss",
    "Reduction",
    "Metric",
    "MetricAccumulator",
    "token_mean_metric",
    "LossFn",
]


class GlobalBatchContext(BaseModel):
    """Counts over the whole mini-batch: every micro-batch on every DP rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    global_num_tokens: int = Field(..., ge=0, description="Loss-mask tokens, all ranks.")
    global_num_samples: int = Field(
        ..., ge=0, description="Samples with >=1 loss token, all ranks."
    )
    dp_size: int = Field(1, ge=1)
    num_micro_batches: int = Field(1, ge=1, description="Micro-batches on this rank.")


class LossAggregation(StrEnum):
    """How per-token loss values become one scalar.

    ``token-mean``: over every loss token of the mini-batch. ``seq-mean-token-mean``: each
    sequence's token mean, averaged over sequences. ``seq-mean-token-sum``: each sequence's
    token sum, averaged. ``seq-mean-token-sum-norm``: each sequence's token sum divided by one
    constant (``norm_length``, e.g. the generation budget), averaged; no term depends on a
    sequence's own length (Dr. GRPO's choice).
    """

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation | str,
    ctx: GlobalBatchContext,
    *,
    norm_length: int | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the globally normalized loss.

    ``values`` and ``mask`` are ``[batch, seq_len]``. Summing the result over all micro-batches
    and DP ranks gives the mean over the whole mini-batch. ``norm_length`` (required by
    ``seq-mean-token-sum-norm``, ignored otherwise) is that mode's constant divisor.
    """
    mask = mask.to(values.dtype)
    mode = LossAggregation(mode)
    if mode is LossAggregation.TOKEN_MEAN:
        return (values * mask).sum() / max(ctx.global_num_tokens, 1)
    per_seq = (values * mask).sum(-1)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        per_seq = per_seq / mask.sum(-1).clamp_min(1)
    elif mode is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM:
        if norm_length is None or norm_length < 1:
            raise ValueError(
                f"loss aggregation {mode} divides each sequence's token sum by a constant "
                f"norm_length >= 1 (e.g. the generation budget), got {norm_length!r}; pass "
                f"norm_length=, or use seq-mean-token-sum."
            )
        per_seq = per_seq / norm_length
    return per_seq.sum() / max(ctx.global_num_samples, 1)


class Reduction(StrEnum):
    """How a metric combines across micro-batches and DP ranks."""

    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"


@dataclass(frozen=True)
class Metric:
    """A metric value with its declared reduction."""

    value: float
    reduction: Reduction = Reduction.MEAN

    def __post_init__(self) -> None:
        # accept plain strings ("sum") and refuse unknown ones here, not at reduce time
        object.__setattr__(self, "reduction", Reduction(self.reduction))
        object.__setattr__(self, "value", float(self.value))

    @classmethod
    def of(cls, value: torch.Tensor | float, reduction: Reduction | str) -> Metric:
        v = value.detach().float().item() if isinstance(value, torch.Tensor) else float(value)
        return cls(v, Reduction(reduction))


def token_mean_metric(values: torch.Tensor, mask: torch.Tensor, ctx: GlobalBatchContext) -> Metric:
    """A per-token quantity averaged over the global batch; invariant to micro-batching and DP."""
    return Metric.of(aggregate_loss(values.detach(), mask, LossAggregation.TOKEN_MEAN, ctx), "sum")


LossFn = Callable[
    [TensorDict, TensorDict, GlobalBatchContext], "tuple[torch.Tensor, Mapping[str, Metric]]"
]


class MetricAccumulator:
    """Collects metrics over micro-batches, then reduces them across a process group."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = {}
        self._reductions: dict[str, Reduction] = {}

    def add(self, name: str, metric: Metric) -> None:
        declared = self._reductions.setdefault(name, metric.reduction)
        if declared is not metric.reduction:
            raise ValueError(
                f"metric {name!r} was declared with reduction {declared} and is now added with "
                f"{metric.reduction}; declare one reduction per metric."
            )
        self._values.setdefault(name, []).append(metric.value)

    def update(self, metrics: Mapping[str, Metric]) -> None:
        for name, metric in metrics.items():
            self.add(name, metric)

    def reduce(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Reduce locally, then across ``group`` (if distributed is initialized): one collective per kind."""
        names = sorted(self._values)
        # one rank alone has nothing to agree on or reduce with
        distributed = (
            dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        )
        # Every rank must hold the same metric names (none included: a rank that logged nothing
        # must not leave the others waiting), or the collectives below would mismatch.
        if distributed:
            # JSON: a metric name may hold any character, a newline included
            gathered = [
                json.loads(raw) for raw in all_gather_bytes(json.dumps(names).encode(), group)
            ]
            if any(g != names for g in gathered):
                raise ValueError(f"ranks logged different metric names: {gathered}")
        if not names:
            return {}
        sums, counts, mins, maxs = [], [], [], []
        for n in names:
            vals = self._values[n]
            sums.append(sum(vals))
            counts.append(float(len(vals)))
            mins.append(min(vals))
            maxs.append(max(vals))
        t_sum = torch.tensor([sums, counts], dtype=torch.float64)
        t_min = torch.tensor(mins, dtype=torch.float64)
        t_max = torch.tensor(maxs, dtype=torch.float64)
        if distributed:
            t_sum = all_reduce_cpu(t_sum, dist.ReduceOp.SUM, group)
            t_min = all_reduce_cpu(t_min, dist.ReduceOp.MIN, group)
            t_max = all_reduce_cpu(t_max, dist.ReduceOp.MAX, group)
        out: dict[str, float] = {}
        for i, n in enumerate(names):
            red = self._reductions[n]
            if red is Reduction.SUM:
                out[n] = float(t_sum[0, i])
            elif red is Reduction.MEAN:
                out[n] = float(t_sum[0, i] / t_sum[1, i])
            elif red is Reduction.MIN:
                out[n] = float(t_min[i])
            else:
                out[n] = float(t_max[i])
        return out
