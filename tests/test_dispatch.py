"""Pure dispatch/collect functions and per-instance mesh registration."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from engine_core.batch import BatchMeta, get_meta, make_batch
from engine_core.dispatch import (
    MeshRank,
    Worker,
    collect_nd,
    dispatch_all_to_all,
    dispatch_nd,
    split_for_dp,
    validate_mesh,
)
from engine_core.errors import DispatchError, MeshRegistrationError


def batch(n: int) -> TensorDict:
    return make_batch(torch.arange(n * 3).view(n, 3), meta=BatchMeta(global_step=4))


def test_split_is_a_view() -> None:
    b = batch(8)
    chunks, pad = split_for_dp(b, 4)
    assert pad == 0
    base = b["input_ids"].untyped_storage().data_ptr()
    for c in chunks:
        assert c["input_ids"].untyped_storage().data_ptr() == base


def test_pad_and_trim_round_trip() -> None:
    b = batch(7)
    ranks = [MeshRank(d, 3, True) for d in range(3)]
    calls, pad = dispatch_nd("actor", ranks, (b,), {})
    assert pad == 2 and [c[0][0].batch_size[0] for c in calls] == [3, 3, 3]
    out = collect_nd("actor", ranks, [a[0] for a, _ in calls], pad)
    assert torch.equal(out["input_ids"], b["input_ids"])
    assert get_meta(out).global_step == 4


def test_collect_orders_by_dp_rank_not_worker_order() -> None:
    b = batch(4)
    ranks = [MeshRank(1, 2, True), MeshRank(0, 2, True)]  # listed out of dp order
    calls, pad = dispatch_nd("actor", ranks, (b,), {})
    out = collect_nd("actor", ranks, [a[0] for a, _ in calls], pad)
    assert torch.equal(out["input_ids"], b["input_ids"])


def test_replicas_get_the_same_chunk_and_one_is_collected() -> None:
    b = batch(4)
    ranks = [MeshRank(w // 2, 2, w % 2 == 0) for w in range(4)]
    calls, _ = dispatch_nd("actor", ranks, (b, "scalar"), {"k": 1})
    assert torch.equal(calls[0][0][0]["input_ids"], calls[1][0][0]["input_ids"])
    assert calls[0][0][1] == "scalar" and calls[3][1] == {"k": 1}
    outs = [torch.full((2,), w) for w in range(4)]
    assert collect_nd("actor", ranks, outs, 0).tolist() == [0, 0, 2, 2]


def test_two_collectors_is_an_error() -> None:
    ranks = [MeshRank(0, 1, True), MeshRank(0, 1, True)]
    with pytest.raises(MeshRegistrationError, match="dp rank 0 has 2 collect ranks"):
        validate_mesh("actor", ranks)


def test_missing_dp_rank_is_an_error() -> None:
    ranks = [MeshRank(0, 2, True), MeshRank(0, 2, False)]
    with pytest.raises(MeshRegistrationError, match="no worker has dp rank 1"):
        validate_mesh("actor", ranks)


def test_all_to_all_needs_one_item_per_worker() -> None:
    assert dispatch_all_to_all(2, ([1, 2],), {}) == [((1,), {}), ((2,), {})]
    with pytest.raises(DispatchError, match="list of 3 items"):
        dispatch_all_to_all(3, ([1, 2],), {})


def test_registration_is_per_instance() -> None:
    a, b = Worker(), Worker()
    a.register_mesh("actor", dp_rank=0, dp_size=2, is_collect=True)
    b.register_mesh("actor", dp_rank=1, dp_size=2, is_collect=True)
    assert a.mesh_rank("actor").dp_rank == 0 and b.mesh_rank("actor").dp_rank == 1
    assert Worker().registered_meshes() == {}
    with pytest.raises(MeshRegistrationError, match="already registered"):
        a.register_mesh("actor", dp_rank=0, dp_size=2, is_collect=True)
    with pytest.raises(MeshRegistrationError, match="registered: \\['actor'\\]"):
        a.mesh_rank("ref")


def test_bad_dp_rank_is_refused() -> None:
    with pytest.raises(MeshRegistrationError, match="dp_rank must be in"):
        MeshRank(2, 2, True)
