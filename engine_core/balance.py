"""Balancing a batch across data-parallel ranks before dispatch.

Every DP rank must get the same number of samples (collectives and micro-batch plans assume it),
and the slowest rank sets the step time, so samples are partitioned into equal-count groups whose
largest workload (real tokens) is as small as we can make it: a longest-first greedy start with
a per-group cardinality cap, then pairwise swaps out of the heaviest group while they help.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import torch
from tensordict import TensorDict

from engine_core.batch import sample_workloads, split_with_meta
from engine_core.errors import BatchError

__all__ = ["balanced_partition", "balance_batch", "inverse_permutation"]


def _greedy(w: np.ndarray, k: int) -> list[list[int]]:
    """Longest first into the least-loaded group that still has room."""
    n = w.size
    m, big_left = divmod(n, k)  # big_left groups get m + 1 items, the others m
    counts = [0] * k
    members: list[list[int]] = [[] for _ in range(k)]
    heap = [(0.0, g) for g in range(k)]
    order = np.argsort(-w, kind="stable")
    for i, s in zip(order.tolist(), w[order].tolist(), strict=True):
        while True:
            load, g = heap[0]
            if counts[g] < (m + 1 if big_left else m):
                break
            heapq.heappop(heap)  # full for good: the room for an extra item is gone
        if counts[g] == m:
            big_left -= 1
        counts[g] += 1
        members[g].append(i)
        heapq.heapreplace(heap, (load + s, g))
    return members


def _swap_search(w: np.ndarray, members: list[list[int]], max_iters: int) -> list[np.ndarray]:
    """Swap one item of the heaviest group with one of another group while that lowers the pair's max.

    Groups live in a padded ``[k, width]`` table, each row sorted; rows are shifted apart by a
    constant so that one ``searchsorted`` over the flattened table finds, for every item of the
    heaviest group and every other group, the partner closest to half their load gap.
    """
    k = len(members)
    width = max(len(g) for g in members)
    top = float(w.max()) if w.size else 0.0
    pad, shift = top + 1.0, 2.0 * top + 3.0  # pads sort last in a row; rows never overlap
    vals = np.full((k, width), pad)
    idx = np.full((k, width), -1, dtype=np.int64)
    counts = np.array([len(g) for g in members], dtype=np.int64)
    for g, items in enumerate(members):
        row = np.asarray(sorted(items, key=lambda i: w[i]), dtype=np.int64)
        vals[g, : row.size], idx[g, : row.size] = w[row], row
    loads = vals.sum(1) - pad * (width - counts)
    offsets = np.arange(k, dtype=np.float64) * shift
    row_first = np.arange(k) * width
    row_last = row_first + counts - 1
    others = np.arange(k)
    for _ in range(max_iters):
        h = int(loads.argmax())
        gaps = loads[h] - loads  # [k]
        a = vals[h, : counts[h]]  # [c]
        flat = (vals + offsets[:, None]).ravel()
        pos = np.searchsorted(flat, a[:, None] - gaps / 2 + offsets)  # [c, k]
        best_max, best = loads[h], None
        for cand in (pos, pos - 1):
            cand = np.clip(cand, row_first, row_last)
            d = a[:, None] - vals.ravel()[cand]
            ok = (d > 0) & (d < gaps) & (others != h)
            pair_max = np.where(ok, np.maximum(loads[h] - d, loads + d), np.inf)
            flat_best = int(pair_max.argmin())
            if pair_max.flat[flat_best] < best_max:
                best_max, best = pair_max.flat[flat_best], (flat_best, cand, d)
        if best is None:
            break
        flat_best, cand, d = best
        ai, j = divmod(flat_best, k)
        bj = int(cand[ai, j]) - j * width
        vals[h, ai], vals[j, bj] = vals[j, bj], vals[h, ai]
        idx[h, ai], idx[j, bj] = idx[j, bj], idx[h, ai]
        loads[h] -= d[ai, j]
        loads[j] += d[ai, j]
        for g in (h, j):  # keep both rows sorted (pads stay last)
            o = np.argsort(vals[g], kind="stable")
            vals[g], idx[g] = vals[g, o], idx[g, o]
    return [np.sort(idx[g, : counts[g]]) for g in range(k)]


def balanced_partition(
    workloads: Sequence[float] | np.ndarray | torch.Tensor, k: int
) -> list[np.ndarray]:
    """Split item indices into ``k`` groups of equal size (±1), minimizing the largest group's sum.

    When ``len(workloads) % k != 0`` the first ``len(workloads) % k`` groups hold one item more.
    Each group's indices are sorted ascending.
    """
    if isinstance(workloads, torch.Tensor):
        workloads = workloads.detach().cpu().numpy()
    w = np.asarray(workloads).reshape(-1)
    n = int(w.size)
    if not 1 <= k <= n:
        raise BatchError(
            f"balanced_partition: k must be between 1 and the number of items ({n}), got {k}; "
            "every group needs at least one item. Pass more items or a smaller k."
        )
    if not (np.issubdtype(w.dtype, np.number) and np.isfinite(w).all() and (w >= 0).all()):
        raise BatchError(
            "balanced_partition: workloads must be finite non-negative numbers (e.g. sequence "
            f"lengths); got dtype {w.dtype} with min {w.min()}."
        )
    w = w.astype(np.float64)  # exact for integer workloads below 2**53
    groups = _swap_search(w, _greedy(w, k), max_iters=4 * n)
    groups.sort(key=lambda g: -g.size)  # the larger groups first, as np.array_split sizes them
    return groups


def inverse_permutation(perm: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """``inv`` with ``inv[perm[i]] == i``: ``reordered[inv]`` puts reordered rows back."""
    if isinstance(perm, torch.Tensor):
        perm = perm.detach().cpu().numpy()
    p = np.asarray(perm, dtype=np.int64).reshape(-1)
    n = p.size
    if n and (p.min() < 0 or p.max() >= n or np.bincount(p, minlength=n).max() != 1):
        raise BatchError(
            f"inverse_permutation: expected a permutation of 0..{n - 1}, got values in "
            f"[{p.min()}, {p.max()}] with repeats or gaps; pass the permutation balance_batch "
            "returned."
        )
    inv = np.empty_like(p)
    inv[p] = np.arange(n, dtype=np.int64)
    return inv


def balance_batch(batch: TensorDict, dp_size: int) -> tuple[TensorDict, np.ndarray]:
    """Reorder ``batch`` so that ``dp_size`` contiguous equal chunks carry balanced loads (real
    tokens, and pixel patches where there are images: :func:`~engine_core.batch.sample_workloads`).

    Returns the reordered batch (with its own copy of the metadata) and the permutation ``perm``
    (``reordered[i] = batch[perm[i]]``); put outputs back with ``out[inverse_permutation(perm)]``.
    When the sample count does not divide by ``dp_size`` the leading chunks hold one sample
    more, as ``torch.tensor_split`` splits.
    """
    groups = balanced_partition(sample_workloads(batch).numpy(), dp_size)
    perm = np.concatenate(groups)
    (reordered,) = split_with_meta(batch, [torch.from_numpy(perm)])
    return reordered, perm
