"""Micro-batch preparation: the one utility every engine uses.

Two modes: a fixed number of samples per micro-batch, or a token budget. With a budget the cap
is strict (no micro-batch holds more real tokens than the budget), samples are spread so the
micro-batches carry similar loads, and every DP rank gets the same number of micro-batches,
agreed by a collective — ranks that disagreed would deadlock in the backend's collectives.
Outputs go back to the input order with :meth:`MicroBatchPlan.restore`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_core.batch import sequence_lengths, split_with_meta
from engine_core.errors import BatchError, TokenBudgetError

__all__ = [
    "MicroBatchPlan",
    "plan_fixed",
    "pack_token_budget",
    "plan_token_budget",
    "prepare_micro_batches",
]


@dataclass(frozen=True)
class MicroBatchPlan:
    """Which samples go in which micro-batch (int64 indices into the batch)."""

    groups: tuple[np.ndarray, ...]

    @property
    def num_micro_batches(self) -> int:
        return len(self.groups)

    @property
    def order(self) -> np.ndarray:
        """Sample indices in micro-batch order (concatenated groups)."""
        return np.concatenate(self.groups) if self.groups else np.zeros(0, dtype=np.int64)

    def split(self, batch: TensorDict) -> list[TensorDict]:
        """The micro-batches, each with its own copy of the batch metadata."""
        return split_with_meta(batch, (torch.from_numpy(g) for g in self.groups))

    def restore_tensor(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate per-micro-batch outputs and put them back in input order."""
        return torch.cat(list(outputs))[torch.from_numpy(np.argsort(self.order, kind="stable"))]

    def restore(self, outputs: Sequence[TensorDict]) -> TensorDict:
        """Concatenate per-micro-batch TensorDicts and put them back in input order."""
        return torch.cat(list(outputs))[torch.from_numpy(np.argsort(self.order, kind="stable"))]


def plan_fixed(num_samples: int, micro_batch_size: int) -> MicroBatchPlan:
    """Contiguous micro-batches of ``micro_batch_size`` samples (the last may be smaller)."""
    if micro_batch_size < 1:
        raise BatchError(f"micro_batch_size must be >= 1, got {micro_batch_size}.")
    idx = np.arange(num_samples, dtype=np.int64)
    return MicroBatchPlan(
        tuple(idx[i : i + micro_batch_size] for i in range(0, num_samples, micro_batch_size))
    )


def pack_token_budget(
    lengths: np.ndarray, max_tokens: int, num_bins: int
) -> list[np.ndarray] | None:
    """Pack items into exactly ``num_bins`` bins of at most ``max_tokens``; None if this fails.

    First longest-first into the least-loaded bin, which balances loads; when that fails, the
    tighter best-fit-decreasing packing at the same count, then a rebalancing pass.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if num_bins < 1 or num_bins > len(lengths):
        return None
    order = np.argsort(-lengths, kind="stable").tolist()
    sizes = lengths.tolist()
    members = _worst_fit(order, sizes, max_tokens, num_bins)
    if members is None:
        members = _best_fit(order, sizes, max_tokens, num_bins)
        if members is None:
            return None
        _rebalance(members, sizes, max_tokens)
    if any(not m for m in members):
        return None
    return [np.sort(np.asarray(m, dtype=np.int64)) for m in members]


def _worst_fit(order: list[int], sizes: list[int], cap: int, k: int) -> list[list[int]] | None:
    # when the least-loaded bin cannot take an item no bin can: failure is known at once
    heap = [(0, b) for b in range(k)]
    members: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, b = heap[0]
        if load + sizes[i] > cap:
            return None
        members[b].append(i)
        heapq.heapreplace(heap, (load + sizes[i], b))
    return members


def _best_fit(order: list[int], sizes: list[int], cap: int, k: int) -> list[list[int]] | None:
    # each item into the fullest bin that still fits it; (load, bin) kept sorted for bisect
    loads = [(0, b) for b in range(k)]
    members: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        pos = bisect.bisect_right(loads, (cap - sizes[i], k)) - 1
        if pos < 0:
            return None
        load, b = loads.pop(pos)
        members[b].append(i)
        bisect.insort(loads, (load + sizes[i], b))
    return members


def _rebalance(members: list[list[int]], sizes: list[int], cap: int) -> None:
    """Move items from the heaviest bin to the lightest while that lowers the maximum."""
    loads = [sum(sizes[i] for i in m) for m in members]
    for _ in range(sum(len(m) for m in members)):
        hi = max(range(len(loads)), key=loads.__getitem__)
        lo = min(range(len(loads)), key=loads.__getitem__)
        gap = loads[hi] - loads[lo]
        # the largest item that fits and strictly narrows the gap
        best = max(
            (i for i in members[hi] if sizes[i] < gap and loads[lo] + sizes[i] <= cap),
            key=sizes.__getitem__,
            default=None,
        )
        if best is None or len(members[hi]) == 1:
            return
        members[hi].remove(best)
        members[lo].append(best)
        loads[hi] -= sizes[best]
        loads[lo] += sizes[best]


def _first_feasible(lengths: np.ndarray, max_tokens: int, start: int) -> int:
    for k in range(start, len(lengths) + 1):
        if pack_token_budget(lengths, max_tokens, k) is not None:
            return k
    return len(lengths) + 1  # unreachable when every sample fits the budget


def plan_token_budget(
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    max_tokens: int,
    *,
    group: dist.ProcessGroup | None = None,
    min_num_micro_batches: int = 1,
) -> MicroBatchPlan:
    """Micro-batches of at most ``max_tokens`` real tokens, the same count on every rank of ``group``."""
    lens = np.asarray(
        lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths, dtype=np.int64
    )
    if max_tokens < 1:
        raise TokenBudgetError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}.")
    over = np.flatnonzero(lens > max_tokens)
    if over.size:
        i = int(over[0])
        raise TokenBudgetError(
            f"sample {i} has {int(lens[i])} tokens, more than max_tokens_per_micro_batch="
            f"{max_tokens} ({over.size} sample(s) over budget). Raise max_tokens_per_micro_batch "
            f"to at least {int(lens.max())} or truncate the sequences."
        )
    distributed = dist.is_available() and dist.is_initialized()
    k = max(math.ceil(int(lens.sum()) / max_tokens), min_num_micro_batches, 1)
    k = _first_feasible(lens, max_tokens, k) if len(lens) else k
    while True:
        if distributed:
            agreed = torch.tensor([k], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
            k = int(agreed)
        if k > len(lens):
            raise TokenBudgetError(
                f"the DP ranks need {k} micro-batches but this rank has only {len(lens)} samples; "
                f"every micro-batch must hold at least one sample. Raise "
                f"max_tokens_per_micro_batch or balance the data across ranks."
            )
        groups = pack_token_budget(lens, max_tokens, k)
        ok = torch.tensor([groups is not None], dtype=torch.int64)
        if distributed:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if bool(ok) and groups is not None:
            return MicroBatchPlan(tuple(groups))
        k += 1


def prepare_micro_batches(
    batch: TensorDict,
    *,
    micro_batch_size: int | None = None,
    max_tokens_per_micro_batch: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[list[TensorDict], MicroBatchPlan]:
    """Split ``batch`` by a fixed size or a token budget; neither gives one micro-batch."""
    if micro_batch_size is not None and max_tokens_per_micro_batch is not None:
        raise BatchError(
            "pass micro_batch_size or max_tokens_per_micro_batch, not both; got "
            f"{micro_batch_size} and {max_tokens_per_micro_batch}."
        )
    n = int(batch.batch_size[0])
    if max_tokens_per_micro_batch is not None:
        plan = plan_token_budget(sequence_lengths(batch), max_tokens_per_micro_batch, group=group)
    else:
        plan = plan_fixed(n, micro_batch_size or max(n, 1))
    return plan.split(batch), plan
