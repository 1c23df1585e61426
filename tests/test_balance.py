"""DP balancing: equal sample counts, a small largest workload, a reversible reordering."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.balance import balance_batch, balanced_partition, inverse_permutation
from engine_core.batch import BatchMeta, get_meta, make_batch, sequence_lengths
from engine_core.errors import BatchError


def _recipe(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.clip(np.rint(rng.lognormal(6.5, 1.0, n)), 16, 8192).astype(np.int64)


def _sums(groups: list[np.ndarray], w: np.ndarray) -> np.ndarray:
    return np.array([w[g].sum() for g in groups])


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_groups_have_equal_counts_and_cover_every_item(data: st.DataObject) -> None:
    w = np.array(data.draw(st.lists(st.integers(0, 1000), min_size=1, max_size=80)))
    k = data.draw(st.integers(1, len(w)))
    groups = balanced_partition(w, k)
    assert len(groups) == k
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(w)))
    sizes = [g.size for g in groups]
    # sizes differ by at most one, the larger groups first (as torch.tensor_split sizes chunks)
    assert sizes == [len(w) // k + (1 if i < len(w) % k else 0) for i in range(k)]
    # local optimality: some heaviest group has no swap with another group lowering their max
    sums = _sums(groups, w)

    def improvable(h: int) -> bool:
        a = w[groups[h]][:, None]
        return any(
            bool((((d := a - w[g][None, :]) > 0) & (d < sums[h] - sums[j])).any())
            for j, g in enumerate(groups)
            if j != h
        )

    assert not all(improvable(int(h)) for h in np.flatnonzero(sums == sums.max()))


@pytest.mark.parametrize(
    "w,k,best",
    [([1, 1, 1, 1, 10, 10], 2, 12), ([8, 7, 6, 5, 4], 2, 15), ([5, 5, 4, 3, 3, 3, 2, 1], 4, 7)],
)
def test_small_instances_reach_the_optimum(w: list[int], k: int, best: int) -> None:
    arr = np.array(w)
    n = len(w)
    # brute force over equal-count splits confirms ``best`` is the optimum
    sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
    opt = min(
        max(sum(arr[list(p[sum(sizes[:i]) : sum(sizes[: i + 1])])]) for i in range(k))
        for p in itertools.permutations(range(n))
    )
    assert opt == best
    assert _sums(balanced_partition(arr, k), arr).max() == best


@pytest.mark.parametrize(
    "n,k,bound",
    [(256, 32, 1.03), (256, 2, 1.00001), (1024, 8, 1.00001), (4096, 32, 1.00001)],
)
def test_quality_on_log_normal_lengths(n: int, k: int, bound: float) -> None:
    w = _recipe(n)
    sums = _sums(balanced_partition(w, k), w)
    assert sums.max() / sums.mean() <= bound


def test_float_and_tensor_workloads() -> None:
    groups = balanced_partition(torch.tensor([0.5, 2.5, 1.0, 2.0]), 2)
    assert sorted(_sums(groups, np.array([0.5, 2.5, 1.0, 2.0])).tolist()) == [3.0, 3.0]


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(BatchError, match="between 1 and the number of items \\(3\\), got 4"):
        balanced_partition([1, 2, 3], 4)
    with pytest.raises(BatchError, match="got 0"):
        balanced_partition([1, 2, 3], 0)
    with pytest.raises(BatchError, match="non-negative"):
        balanced_partition([1, -2, 3], 2)
    with pytest.raises(BatchError, match="expected a permutation of 0..2"):
        inverse_permutation([0, 0, 2])


def test_balance_batch_chunks_are_balanced_and_reversible() -> None:
    lengths = [30, 1, 2, 28, 3, 29, 4, 5, 6, 7, 8]
    seq_len = max(lengths)
    mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).long()
    batch = make_batch(
        torch.arange(len(lengths) * seq_len).reshape(len(lengths), seq_len) * mask,
        mask,
        meta=BatchMeta(global_step=5),
        non_tensor={"uid": [f"u{i}" for i in range(len(lengths))]},
    )
    reordered, perm = balance_batch(batch, 3)
    chunks = torch.tensor_split(sequence_lengths(reordered), 3)
    assert [len(c) for c in chunks] == [4, 4, 3]
    assert [int(c.sum()) for c in chunks] == [41, 41, 41]  # 123 tokens: a perfect split exists
    assert list(reordered["uid"]) == [f"u{i}" for i in perm]
    get_meta(reordered).global_step = 9  # the reordered batch owns its metadata
    assert get_meta(batch).global_step == 5
    back = reordered[torch.from_numpy(inverse_permutation(perm))]
    assert torch.equal(back["input_ids"], batch["input_ids"])
    assert list(back["uid"]) == list(batch["uid"])
