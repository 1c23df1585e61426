"""Gathers between our own ranks go as fixed-format tensors: bytes, TensorDicts, metric names.

One launch of three gloo ranks runs every case (each launch costs seconds); the tests below read
its results. The worker first makes pickle-based gathering raise, so every case also shows that
nothing is unpickled.
"""

from __future__ import annotations

import pickle
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_core.comm import all_gather_bytes, all_gather_tensordict
from engine_core.loss import Metric, MetricAccumulator, Reduction
from tests._dist import run_distributed

WORLD_SIZE = 3
ROWS = [3, 0, 2]  # rows per rank; rank 1 holds none
BYTES = [b"", b"\x00\xffab\n", "é".encode() * 5]


def _part(rank: int) -> TensorDict:
    """Rank ``rank``'s outputs: nested keys, int64/float32/bool leaves, 2-D and 3-D."""
    g = torch.Generator().manual_seed(rank)
    n = ROWS[rank]
    return TensorDict(
        {
            "log_probs": torch.randn(n, 4, generator=g),
            "ids": torch.randint(0, 100, (n, 4), generator=g),
            "extra": {
                "mask": torch.rand(n, 4, generator=g) > 0.5,
                "hidden": torch.randn(n, 4, 2, generator=g),
            },
        },
        batch_size=[n],
    )


def _refuse(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("a gather between ranks unpickled its input")


def _error(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    c10d = dist.distributed_c10d
    for module, name in [
        (dist, "all_gather_object"),
        (c10d, "all_gather_object"),
        (c10d, "_tensor_to_object"),
        (pickle, "loads"),
        (pickle, "Unpickler"),
    ]:
        setattr(module, name, _refuse)

    out: dict[str, Any] = {
        "bytes": all_gather_bytes(BYTES[rank]),
        "no_bytes": all_gather_bytes(b""),
        "gathered": all_gather_tensordict(_part(rank)),
    }

    acc = MetricAccumulator()
    acc.add("loss", Metric(float(rank), Reduction.MEAN))
    acc.add("peak", Metric(float(rank), Reduction.MAX))
    out["metrics"] = acc.reduce()
    uneven = MetricAccumulator()
    uneven.add("loss" if rank < 2 else "lost", Metric(1.0, Reduction.SUM))
    out["names_error"] = _error(uneven.reduce)

    extra_key = _part(rank)
    if rank == 1:
        extra_key["stray"] = torch.zeros(ROWS[rank])
    out["keys_error"] = _error(all_gather_tensordict, extra_key)
    other_dtype = _part(rank)
    if rank == 2:
        other_dtype["ids"] = other_dtype["ids"].double()
    out["dtype_error"] = _error(all_gather_tensordict, other_dtype)
    text = _part(rank)
    text.set_non_tensor("note", "hello")
    out["non_tensor_error"] = _error(all_gather_tensordict, text)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD_SIZE)


def test_bytes_of_every_length_in_rank_order(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["bytes"] == BYTES
        assert r["no_bytes"] == [b""] * WORLD_SIZE


def test_tensordict_parts_are_concatenated_in_rank_order(ranks: list[dict[str, Any]]) -> None:
    expected = torch.cat([_part(r) for r in range(WORLD_SIZE)])
    for r in ranks:
        gathered = r["gathered"]
        assert gathered.batch_size == torch.Size([sum(ROWS)])
        assert set(gathered.keys(include_nested=True, leaves_only=True)) == set(
            expected.keys(include_nested=True, leaves_only=True)
        )
        for key, want in expected.items(include_nested=True, leaves_only=True):
            assert gathered[key].dtype == want.dtype, key
            torch.testing.assert_close(gathered[key], want, rtol=0, atol=0)


def test_metric_reduction_without_pickle(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["metrics"] == {"loss": 1.0, "peak": 2.0}
        assert "ranks logged different metric names" in r["names_error"]
        assert "['lost']" in r["names_error"]


def test_layout_mismatch_names_the_ranks(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:  # every rank raises, none is left waiting
        assert "rank 1 holds keys" in r["keys_error"]
        assert "['stray']" in r["keys_error"]
        assert "but rank 0 holds" in r["keys_error"]
        assert "rank 2 holds ['ids'] as torch.float64" in r["dtype_error"]
        assert "rank 0 as torch.int64" in r["dtype_error"]
        assert "'note'" in r["non_tensor_error"]
        assert "outputs must be tensors" in r["non_tensor_error"]
