"""Padded ↔ packed layouts: round trips, per-sequence positions, boundaries and errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.errors import BatchError
from engine_core.packing import pack, pack_tensor, sequence_start_mask, unpack


def _padded(lengths: list[int], seq_len: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor(lengths)
    pos = torch.arange(seq_len).expand(len(lengths), seq_len)
    mask = pos >= (seq_len - lens)[:, None] if side == "left" else pos < lens[:, None]
    ids = torch.randint(
        1, 1000, (len(lengths), seq_len), generator=torch.Generator().manual_seed(0)
    )
    return ids * mask, mask.long()


@pytest.mark.parametrize("side", ["left", "right"])
def test_pack_layout_and_round_trip(side: str) -> None:
    ids, mask = _padded([3, 5, 1, 4], seq_len=6, side=side)
    packed = pack(ids, mask)
    assert packed.input_ids.shape == (1, 13) and packed.num_tokens == 13
    assert packed.input_ids[0].tolist() == ids[mask.bool()].tolist()
    # positions restart at 0 for every sequence
    assert packed.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 0, 1, 2, 3]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 3, 8, 9, 13] and packed.max_seqlen == 5
    starts = sequence_start_mask(packed)
    assert starts.dtype == torch.bool
    assert starts[0].nonzero().squeeze(-1).tolist() == [0, 3, 8, 9]
    assert torch.equal(unpack(packed, packed.input_ids), ids)
    assert torch.equal(unpack(packed, packed.input_ids[0]), ids)


@pytest.mark.parametrize("side", ["left", "right"])
def test_pack_tensor_and_unpack_with_trailing_dims(side: str) -> None:
    ids, mask = _padded([2, 4, 3], seq_len=5, side=side)
    packed = pack(ids, mask)
    hidden = torch.randn(3, 5, 2)
    flat = pack_tensor(packed, hidden)
    assert flat.shape == (1, 9, 2)
    assert torch.equal(flat[0], hidden[mask.bool()])
    back = unpack(packed, flat, fill=-1.0)
    assert torch.equal(back[mask.bool()], hidden[mask.bool()])
    assert (back[~mask.bool()] == -1.0).all()


def test_empty_rows_and_padding_on_both_sides() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    ids = torch.arange(12).reshape(3, 4) * mask
    packed = pack(ids, mask)
    assert packed.cu_seqlens.tolist() == [0, 2, 2, 6]
    assert packed.position_ids[0].tolist() == [0, 1, 0, 1, 2, 3]
    assert sequence_start_mask(packed)[0].tolist() == [True, False, True, False, False, False]
    assert torch.equal(unpack(packed, packed.input_ids), ids)


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    side=st.sampled_from(["left", "right"]),
)
def test_round_trip_and_positions_on_random_lengths(lengths: list[int], side: str) -> None:
    seq_len = max(lengths) + 2
    ids, mask = _padded(lengths, seq_len, side)
    packed = pack(ids, mask)
    assert torch.equal(unpack(packed, packed.input_ids), ids)
    expect = [p for n in lengths for p in range(n)]
    assert packed.position_ids[0].tolist() == expect
    assert int(sequence_start_mask(packed).sum()) == sum(1 for n in lengths if n > 0)
    assert packed.cu_seqlens.diff().tolist() == lengths


def test_errors_say_what_is_wrong() -> None:
    with pytest.raises(BatchError, match=r"row\(s\) \[1\].*holes"):
        pack(torch.ones(2, 4, dtype=torch.long), torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]]))
    with pytest.raises(BatchError, match="one shape"):
        pack(torch.ones(2, 4, dtype=torch.long), torch.ones(2, 3))
    packed = pack(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3))
    with pytest.raises(BatchError, match=r"shape \[2, 3, \.\.\.\]"):
        pack_tensor(packed, torch.zeros(3, 2))
    with pytest.raises(BatchError, match=r"\[1, 6, \.\.\.\] or \[6, \.\.\.\].*got \(5,\)"):
        unpack(packed, torch.zeros(5))
