"""Micro-batch preparation: the one utility every engine uses.

Two modes: a fixed number of samples per micro-batch, or a token budget. With a budget the cap
is strict (no micro-batch holds more real tokens than the budget), samples are spread so the
micro-batches carry similar loads, and every DP rank gets the same number of micro-batches,
agreed by a collective: ranks that disagreed would deadlock in the backend's collectives.
Outputs go back to the input order with :meth:`MicroBatchPlan.restore`.
"""

from __future__ import annotations

import copy
import heapq
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_core.batch import META_KEY, get_meta, sample_workloads, set_meta, split_with_meta
from engine_core.comm import all_reduce_cpu
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
    """Which samples go in which micro-batch: one int64 index array into the batch per group."""

    groups: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        groups = tuple(np.asarray(g, dtype=np.int64).reshape(-1) for g in self.groups)
        object.__setattr__(self, "groups", groups)

    @property
    def num_micro_batches(self) -> int:
        return len(self.groups)

    @property
    def order(self) -> np.ndarray:
        """Sample indices in micro-batch order (the groups concatenated)."""
        return np.concatenate(self.groups) if self.groups else np.zeros(0, dtype=np.int64)

    def is_whole(self, num_samples: int) -> bool:
        """Whether the plan is one micro-batch holding all ``num_samples`` samples in order."""
        return (
            len(self.groups) == 1
            and self.groups[0].size == num_samples
            and bool((self.groups[0] == np.arange(num_samples)).all())
        )

    def split(self, batch: TensorDict) -> list[TensorDict]:
        """The micro-batches, each with its own deep copy of the batch metadata. A plan of one
        micro-batch in input order gives a shallow copy of ``batch`` (its tensors, not copies)."""
        if self.is_whole(int(batch.batch_size[0])):
            whole = batch.copy()
            set_meta(whole, copy.deepcopy(get_meta(batch)))
            return [whole]
        return split_with_meta(batch, (torch.from_numpy(g) for g in self.groups))

    def _inverse(self, sizes: Sequence[int]) -> torch.Tensor:
        want = [len(g) for g in self.groups]
        if list(sizes) != want or not want:
            raise BatchError(
                f"restore: got outputs with {list(sizes)} samples per micro-batch, but the plan "
                f"has {want}; pass one output per micro-batch, in plan order (an empty plan "
                "has nothing to restore)."
            )
        order = self.order
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size, dtype=np.int64)
        return torch.from_numpy(inverse)

    def restore_tensor(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate per-micro-batch tensors (dim 0 = samples) and return them in input order."""
        inverse = self._inverse([int(o.shape[0]) for o in outputs])
        return torch.cat(list(outputs))[inverse.to(outputs[0].device)]

    def restore(self, outputs: Sequence[TensorDict]) -> TensorDict:
        """Concatenate per-micro-batch TensorDicts and return them in input order.

        Non-tensor per-sample entries follow their samples. Batch metadata, if the outputs carry
        it, is taken from the first output (the copies may have been changed independently).
        """
        inverse = self._inverse([int(o.batch_size[0]) for o in outputs])
        if self.is_whole(inverse.numel()):  # one micro-batch in input order: nothing to undo
            return outputs[0]
        restored: TensorDict = TensorDict.cat([o.exclude(META_KEY) for o in outputs])[inverse]
        if META_KEY in outputs[0].keys():
            set_meta(restored, get_meta(outputs[0]))
        return restored


def plan_fixed(num_samples: int, micro_batch_size: int) -> MicroBatchPlan:
    """Contiguous micro-batches of ``micro_batch_size`` samples (the last may be smaller)."""
    if micro_batch_size < 1:
        raise BatchError(
            f"micro_batch_size must be >= 1, got {micro_batch_size}; pass a positive size, or "
            "None for one micro-batch holding the whole batch."
        )
    idx = np.arange(num_samples, dtype=np.int64)
    return MicroBatchPlan(
        tuple(idx[i : i + micro_batch_size] for i in range(0, num_samples, micro_batch_size))
    )


def _worst_fit(order: list[int], sizes: list[int], cap: int, k: int) -> list[list[int]] | None:
    # each item into the least-loaded bin: balanced, and if that bin cannot take it none can;
    # ties go to the bin with fewer items, so zero-length samples do not leave bins empty
    heap = [(0, 0, b) for b in range(k)]
    members: list[list[int]] = [[] for _ in range(k)]
    for i, s in zip(order, sizes, strict=True):
        load, count, b = heap[0]
        if load + s > cap:
            return None
        members[b].append(i)
        heapq.heapreplace(heap, (load + s, count + 1, b))
    return members


def _best_fit(order: list[int], sizes: list[int], cap: int, k: int) -> list[list[int]] | None:
    # each item into the fullest bin that still takes it: tighter than worst fit, unbalanced
    loads, ids = [0] * k, list(range(k))  # loads kept sorted ascending
    members: list[list[int]] = [[] for _ in range(k)]
    for i, s in zip(order, sizes, strict=True):
        pos = bisect_right(loads, cap - s) - 1
        if pos < 0:
            return None
        load, b = loads.pop(pos) + s, ids.pop(pos)
        members[b].append(i)
        j = bisect_right(loads, load)
        loads.insert(j, load)
        ids.insert(j, b)
    return members


def _rebalance(members: list[list[int]], lengths: np.ndarray, max_iters: int) -> None:
    """Move or swap items between the heaviest and lightest bins while that narrows their gap."""
    sizes = [[int(lengths[i]) for i in m] for m in members]
    loads = np.array([sum(s) for s in sizes], dtype=np.int64)
    for _ in range(max_iters):
        h, lo = int(loads.argmax()), int(loads.argmin())
        gap = int(loads[h] - loads[lo])
        # (distance of the moved amount from gap / 2, index in heaviest, index in lightest);
        # index -1 in the lightest is a zero-size stand-in, i.e. a plain move
        best = (gap, -1, -1)
        for a, sa in enumerate(sizes[h]):
            for b, sb in enumerate([0, *sizes[lo]], start=-1):
                if 0 < sa - sb < gap:
                    best = min(best, (abs(gap - 2 * (sa - sb)), a, b))
        if best[1] < 0:
            return
        _, a, b = best
        moved = sizes[h][a] - (sizes[lo][b] if b >= 0 else 0)
        members[lo].append(members[h][a])
        sizes[lo].append(sizes[h][a])
        if b >= 0:
            members[h][a], sizes[h][a] = members[lo].pop(b), sizes[lo].pop(b)
        else:
            members[h].pop(a)
            sizes[h].pop(a)
        loads[h] -= moved
        loads[lo] += moved


def _fill_empty(members: list[list[int]], lengths: np.ndarray) -> None:
    # an empty bin takes the smallest item of a bin holding several; any single item fits
    for empty in (m for m in members if not m):
        donor = max(members, key=len)
        empty.append(donor.pop(min(range(len(donor)), key=lambda t: lengths[donor[t]])))


def pack_token_budget(
    lengths: np.ndarray, max_tokens: int, num_bins: int
) -> list[np.ndarray] | None:
    """Pack items into exactly ``num_bins`` non-empty bins of at most ``max_tokens``, or None.

    Longest first into the least-loaded bin keeps the loads balanced; when that fails, a
    best-fit pass packs tighter and a rebalancing pass then evens out the loads. Every bin
    respects the cap whatever happens. Each bin's indices are sorted ascending.
    """
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if num_bins < 1 or num_bins > lens.size or (lens.size and int(lens.max()) > max_tokens):
        return None
    order_np = np.argsort(-lens, kind="stable")
    order, sizes = order_np.tolist(), lens[order_np].tolist()
    members = _worst_fit(order, sizes, max_tokens, num_bins)
    if members is None:
        members = _best_fit(order, sizes, max_tokens, num_bins)
        if members is None:
            return None
        _fill_empty(members, lens)
        _rebalance(members, lens, max_iters=2 * num_bins)
    assert all(members), "every bin holds a sample when num_bins <= len(lengths)"
    return [np.sort(np.asarray(m, dtype=np.int64)) for m in members]


def _as_lengths(lengths: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.detach().cpu().numpy()
    lens = np.asarray(lengths).reshape(-1)
    if lens.size and (not np.issubdtype(lens.dtype, np.integer) or int(lens.min()) < 0):
        raise TokenBudgetError(
            f"sample lengths must be non-negative integers, got dtype {lens.dtype} with minimum "
            f"{lens.min()}; pass real-token counts such as attention_mask.sum(-1)."
        )
    return lens.astype(np.int64)


def _all_reduce(
    values: list[int], op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None
) -> list[int]:
    t = all_reduce_cpu(torch.tensor(values, dtype=torch.int64), op, group)
    return [int(v) for v in t.tolist()]


def plan_token_budget(
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    max_tokens: int,
    *,
    group: dist.ProcessGroup | None = None,
    min_num_micro_batches: int = 1,
) -> MicroBatchPlan:
    """Micro-batches of at most ``max_tokens`` real tokens, the same count on every rank of ``group``.

    When ``torch.distributed`` is initialized every rank of ``group`` (default: the world) must
    call this together. A sample over the budget, or too few samples for the agreed count, on
    any rank makes every rank raise, so no rank is left waiting in a collective.
    """
    if max_tokens < 1:
        raise TokenBudgetError(
            f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}; pass a positive budget."
        )
    lens = _as_lengths(lengths)
    n = int(lens.size)
    # a group only exists once torch.distributed is initialized; None then means the world
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    where = f"rank {dist.get_rank(group)}: " if distributed else ""
    over = np.flatnonzero(lens > max_tokens)
    k = max(math.ceil(int(lens.sum()) / max_tokens), min_num_micro_batches, 1)
    local_k, groups = k, None
    if not over.size:  # the least k that packs here; k = n always packs (one sample per bin)
        while k <= n and (groups := pack_token_budget(lens, max_tokens, k)) is None:
            k += 1
        local_k = k
    any_over = int(over.size > 0)
    if distributed:
        k, any_over = _all_reduce([k, any_over], dist.ReduceOp.MAX, group)
    if over.size:
        i = int(over[0])
        raise TokenBudgetError(
            f"{where}sample {i} has {int(lens[i])} tokens (pixel patches count as tokens), "
            f"more than max_tokens_per_micro_batch="
            f"{max_tokens} ({over.size} sample(s) over budget). Raise max_tokens_per_micro_batch "
            f"to at least {int(lens.max())} or truncate the sequences."
        )
    if any_over:
        raise TokenBudgetError(
            f"{where}another DP rank has a sample longer than max_tokens_per_micro_batch="
            f"{max_tokens} (see its error). Raise the budget or truncate the sequences."
        )
    while True:
        if k != local_k:  # the agreed count differs from this rank's own: pack again
            groups = pack_token_budget(lens, max_tokens, k) if k <= n else None
        status = 1 if groups is not None else (-1 if k > n else 0)  # -1: too few samples
        if distributed:
            (status,) = _all_reduce([status], dist.ReduceOp.MIN, group)
        if status == 1 and groups is not None:
            return MicroBatchPlan(tuple(groups))
        if status < 0:
            raise TokenBudgetError(
                f"{where}{k} micro-batches are needed (agreed across DP ranks: at least "
                f"{min_num_micro_batches}, and enough for every rank's tokens) but some rank has "
                f"fewer samples (this one has {n}); a micro-batch cannot be empty. Raise "
                "max_tokens_per_micro_batch or balance the data across ranks."
            )
        k += 1


def prepare_micro_batches(
    batch: TensorDict,
    *,
    micro_batch_size: int | None = None,
    max_tokens_per_micro_batch: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[list[TensorDict], MicroBatchPlan]:
    """Split ``batch`` by a fixed size or a token budget; neither gives one micro-batch.

    The token budget counts real tokens, and pixel patches where there are images
    (:func:`~engine_core.batch.sample_workloads`).
    """
    if micro_batch_size is not None and max_tokens_per_micro_batch is not None:
        raise BatchError(
            "pass micro_batch_size or max_tokens_per_micro_batch, not both; got "
            f"micro_batch_size={micro_batch_size} and max_tokens_per_micro_batch="
            f"{max_tokens_per_micro_batch}."
        )
    n = int(batch.batch_size[0])
    if max_tokens_per_micro_batch is not None:
        plan = plan_token_budget(sample_workloads(batch), max_tokens_per_micro_batch, group=group)
    else:
        plan = plan_fixed(n, micro_batch_size if micro_batch_size is not None else max(n, 1))
    return plan.split(batch), plan
