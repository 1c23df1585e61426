"""Micro-batch planning: fixed size, strict token budget, agreement across ranks, restore order."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from engine_core.batch import BatchMeta, get_meta, make_batch, sequence_lengths
from engine_core.errors import BatchError, TokenBudgetError
from engine_core.microbatch import (
    MicroBatchPlan,
    _fill_empty,
    pack_token_budget,
    plan_fixed,
    plan_token_budget,
    prepare_micro_batches,
)
from tests._dist import run_distributed


def _loads(plan: MicroBatchPlan, lengths: np.ndarray) -> np.ndarray:
    return np.array([int(lengths[g].sum()) for g in plan.groups])


def _check_plan(plan: MicroBatchPlan, lengths: np.ndarray, budget: int) -> None:
    assert sorted(plan.order.tolist()) == list(range(len(lengths)))  # each index exactly once
    assert all(g.size > 0 for g in plan.groups)
    assert (_loads(plan, lengths) <= budget).all()


def _batch(lengths: list[int], seq_len: int, *, left_pad: bool = False) -> TensorDict:
    lens = torch.tensor(lengths)
    pos = torch.arange(seq_len).expand(len(lengths), seq_len)
    mask = pos >= (seq_len - lens)[:, None] if left_pad else pos < lens[:, None]
    ids = (torch.arange(len(lengths))[:, None] * 100 + pos + 1) * mask
    return make_batch(
        ids,
        mask.long(),
        meta=BatchMeta(temperature=0.7, global_step=3),
        non_tensor={"tag": [f"sample-{i}" for i in range(len(lengths))]},
        rewards=torch.arange(len(lengths), dtype=torch.float32),
    )


def test_plan_fixed_is_contiguous_with_smaller_last() -> None:
    plan = plan_fixed(7, 3)
    assert [g.tolist() for g in plan.groups] == [[0, 1, 2], [3, 4, 5], [6]]
    assert plan.num_micro_batches == 3 and all(g.dtype == np.int64 for g in plan.groups)
    with pytest.raises(BatchError, match="micro_batch_size must be >= 1, got 0"):
        plan_fixed(4, 0)


@settings(max_examples=200, deadline=None)
@example(lengths=[0, 0, 0], budget=300, min_mbs=3)  # zero-length samples must still spread
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=120),
    budget=st.integers(300, 1200),
    min_mbs=st.integers(1, 6),
)
def test_token_budget_is_never_exceeded_and_covers_every_sample(
    lengths: list[int], budget: int, min_mbs: int
) -> None:
    lens = np.array(lengths)
    if min_mbs > len(lens):
        with pytest.raises(TokenBudgetError, match="a micro-batch cannot be empty"):
            plan_token_budget(lens, budget, min_num_micro_batches=min_mbs)
        return
    plan = plan_token_budget(lens, budget, min_num_micro_batches=min_mbs)
    _check_plan(plan, lens, budget)
    assert plan.num_micro_batches >= max(math.ceil(lens.sum() / budget), min_mbs)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 100), min_size=1, max_size=60),
    budget=st.integers(100, 400),
    num_bins=st.integers(1, 70),
)
def test_pack_token_budget_returns_a_valid_packing_or_none(
    lengths: list[int], budget: int, num_bins: int
) -> None:
    lens = np.array(lengths)
    bins = pack_token_budget(lens, budget, num_bins)
    if num_bins > len(lens) or lens.sum() > budget * num_bins:
        assert bins is None
    if bins is not None:
        _check_plan(MicroBatchPlan(tuple(bins)), lens, budget)
        assert len(bins) == num_bins


def test_tight_instance_packs_where_least_loaded_placement_fails() -> None:
    # longest-first into the least-loaded bin gives 5 + 5 and then cannot place the last 2
    bins = pack_token_budget(np.array([3, 3, 2, 2, 2]), 6, 2)
    assert bins is not None
    assert sorted(int(np.array([3, 3, 2, 2, 2])[b].sum()) for b in bins) == [6, 6]
    assert plan_token_budget([3, 3, 2, 2, 2], 6).num_micro_batches == 2


def test_an_empty_bin_takes_the_smallest_sample_of_a_fuller_one() -> None:
    members: list[list[int]] = [[0], [1, 2, 3], []]
    _fill_empty(members, np.array([9, 5, 2, 7]))
    assert members == [[0], [1, 3], [2]]


@pytest.mark.parametrize("n,budget", [(1024, 8192), (4096, 8192), (4096, 16384)])
def test_count_is_near_the_lower_bound_and_loads_are_balanced(n: int, budget: int) -> None:
    rng = np.random.default_rng(0)
    lens = np.clip(np.rint(rng.lognormal(6.5, 1.0, n)), 16, 8192).astype(np.int64)
    plan = plan_token_budget(lens, budget)
    _check_plan(plan, lens, budget)
    assert plan.num_micro_batches <= math.ceil(lens.sum() / budget) + 1
    loads = _loads(plan, lens)
    assert loads.max() / loads.mean() < 1.02


def test_loads_are_spread_when_the_budget_is_loose() -> None:
    lens = np.full(40, 10)
    plan = plan_token_budget(lens, 130, min_num_micro_batches=4)
    assert plan.num_micro_batches == 4
    assert _loads(plan, lens).tolist() == [100, 100, 100, 100]


def test_sample_over_budget_names_the_sample_and_the_fix() -> None:
    with pytest.raises(TokenBudgetError) as err:
        plan_token_budget([5, 9, 70, 3], 64)
    msg = str(err.value)
    for part in ("sample 2", "70 tokens", "max_tokens_per_micro_batch=64", "truncate"):
        assert part in msg


def test_bad_budget_and_lengths_are_refused() -> None:
    with pytest.raises(TokenBudgetError, match="must be >= 1, got 0"):
        plan_token_budget([1, 2], 0)
    with pytest.raises(TokenBudgetError, match="non-negative integers"):
        plan_token_budget([1, -2], 10)


def test_restore_gives_input_order_back_with_non_tensor_and_meta() -> None:
    batch = _batch([7, 1, 5, 3, 8, 2, 6, 4], seq_len=8, left_pad=True)
    parts, plan = prepare_micro_batches(batch, max_tokens_per_micro_batch=12)
    assert plan.num_micro_batches == 3
    assert sorted(plan.order.tolist()) == list(range(8)) and plan.order.tolist() != list(range(8))
    for part, group in zip(parts, plan.groups, strict=True):
        assert int(sequence_lengths(part).sum()) <= 12
        assert list(part["tag"]) == [f"sample-{i}" for i in group]
    # every micro-batch owns its metadata: changing one leaves the others and the input alone
    get_meta(parts[0]).temperature = 2.0
    assert get_meta(parts[1]).temperature == 0.7 and get_meta(batch).temperature == 0.7
    restored = plan.restore(parts)
    assert torch.equal(restored["input_ids"], batch["input_ids"])
    assert list(restored["tag"]) == list(batch["tag"])
    assert get_meta(restored).global_step == 3
    outputs = [TensorDict({"score": p["rewards"] * 2}, batch_size=p.batch_size) for p in parts]
    assert torch.equal(plan.restore(outputs)["score"], batch["rewards"] * 2)
    assert torch.equal(plan.restore_tensor([p["rewards"] for p in parts]), batch["rewards"])


def test_restore_refuses_outputs_that_do_not_match_the_plan() -> None:
    plan = plan_fixed(5, 2)
    with pytest.raises(BatchError, match=r"\[2, 3\] samples per micro-batch.*\[2, 2, 1\]"):
        plan.restore_tensor([torch.zeros(2), torch.zeros(3)])


def test_prepare_micro_batches_modes() -> None:
    batch = _batch([2, 2, 2, 2, 2], seq_len=10)  # padding does not count against the budget
    parts, plan = prepare_micro_batches(batch, max_tokens_per_micro_batch=4)
    assert plan.num_micro_batches == 3 and [len(p) for p in parts] == [2, 2, 1]
    parts, plan = prepare_micro_batches(batch, micro_batch_size=2)
    assert [g.tolist() for g in plan.groups] == [[0, 1], [2, 3], [4]]
    parts, plan = prepare_micro_batches(batch)
    assert plan.num_micro_batches == 1 and torch.equal(parts[0]["input_ids"], batch["input_ids"])
    with pytest.raises(BatchError, match="not both"):
        prepare_micro_batches(batch, micro_batch_size=2, max_tokens_per_micro_batch=8)


def test_one_micro_batch_in_order_is_the_batch_with_its_own_metadata() -> None:
    batch = _batch([3, 1, 2], seq_len=4)
    [part], plan = prepare_micro_batches(batch)
    assert plan.is_whole(3) and not plan_fixed(3, 2).is_whole(3)
    assert not MicroBatchPlan((np.array([1, 0, 2]),)).is_whole(3)
    assert part["input_ids"] is batch["input_ids"]  # no copy of the tensors
    assert list(part["tag"]) == list(batch["tag"])
    get_meta(part).temperature = 2.0  # its metadata is its own
    assert get_meta(batch).temperature == 0.7
    out = TensorDict({"score": part["rewards"] * 2}, batch_size=part.batch_size)
    assert plan.restore([out]) is out
    # a reordered single group is still gathered and put back in input order
    shuffled = MicroBatchPlan((np.array([2, 0, 1]),))
    [moved] = shuffled.split(batch)
    assert moved["rewards"].tolist() == batch["rewards"][[2, 0, 1]].tolist()
    assert torch.equal(shuffled.restore([moved])["rewards"], batch["rewards"])


def _ranks_agree(rank: int, world_size: int, budget: int) -> dict:
    rng = np.random.default_rng(rank)
    # rank 0 holds many short sequences, rank 1 fewer long ones: alone they need different counts
    lens = rng.integers(5, 20, size=48) if rank == 0 else rng.integers(150, 250, size=24)
    solo = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    alone = plan_token_budget(lens, budget, group=solo[rank])
    plan = plan_token_budget(lens, budget)
    _check_plan(plan, lens, budget)
    errors = {}
    # a sample over budget on rank 1 only, then too few samples on rank 0 only: both ranks fail
    over = np.append(lens, budget + 1) if rank == 1 else lens
    few = lens[:2] if rank == 0 else lens
    for name, case in (("over", over), ("few", few)):
        try:
            plan_token_budget(case, budget)
        except TokenBudgetError as e:
            errors[name] = str(e)
    return {"alone": alone.num_micro_batches, "count": plan.num_micro_batches, "errors": errors}


def test_ranks_with_different_data_agree_on_the_micro_batch_count() -> None:
    r0, r1 = run_distributed(_ranks_agree, 2, 512)
    assert r0["alone"] < r1["alone"]  # the data really differ
    assert r0["count"] == r1["count"] == r1["alone"]
    assert "sample 24" in r1["errors"]["over"] and "another DP rank" in r0["errors"]["over"]
    assert "this one has 2" in r0["errors"]["few"]
    assert "balance the data across ranks" in r1["errors"]["few"]
