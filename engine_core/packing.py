"""Padded ↔ packed layouts for padding-free execution.

Packing concatenates the real tokens of every row into one row ``[1, T]`` with per-sequence
position ids (restarting at 0) and ``cu_seqlens`` boundaries. The real tokens of each padded row
must be contiguous (right padding, left padding, or both sides). A model sees the packed row
as separate sequences only through the restarting position ids, and transformers honours them
only without a KV cache: call it with ``use_cache=False``, else attention leaks across them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.errors import BatchError

__all__ = ["PackedSequences", "pack", "pack_tensor", "unpack", "sequence_start_mask"]


@dataclass(frozen=True)
class PackedSequences:
    """One packed row and what is needed to unpack it."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # int32 [n + 1]
    max_seqlen: int
    flat_indices: torch.Tensor  # int64 [T], positions in the flattened [B * L] padded layout
    batch_size: int
    seq_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.flat_indices.numel())


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedSequences:
    """Pack the real tokens of ``input_ids`` ``[B, L]`` into one row."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise BatchError(
            f"pack needs input_ids and attention_mask of one shape [B, L]; got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}."
        )
    mask = attention_mask.bool()
    lengths = mask.sum(-1)
    # contiguity: exactly one 0->1 edge per non-empty row
    starts = mask & ~torch.nn.functional.pad(mask, (1, 0))[:, :-1]
    holes = (starts.sum(-1) > 1).nonzero().squeeze(-1)
    if holes.numel():
        raise BatchError(
            f"pack: the real tokens of a row must be contiguous (left/right padding only), but "
            f"row(s) {holes.tolist()[:8]} of the attention_mask have holes; rebuild it without."
        )
    b, seq_len = input_ids.shape
    dev = input_ids.device  # everything stays on the input's device (kernels read cu_seqlens there)
    flat_indices = mask.reshape(-1).nonzero().squeeze(-1)
    cu = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    cu[1:] = lengths.cumsum(0).to(torch.int32)
    # position within its own sequence: global index minus the sequence's start offset
    seq_of_token = torch.repeat_interleave(torch.arange(b, device=dev), lengths)
    positions = torch.arange(flat_indices.numel(), device=dev) - cu[:-1].long()[seq_of_token]
    return PackedSequences(
        input_ids=input_ids.reshape(-1)[flat_indices].unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        cu_seqlens=cu,
        max_seqlen=int(lengths.max()) if b else 0,
        flat_indices=flat_indices,
        batch_size=b,
        seq_len=seq_len,
    )


def pack_tensor(packed: PackedSequences, tensor: torch.Tensor) -> torch.Tensor:
    """Pack another per-token tensor ``[B, L, ...]`` the same way: ``[1, T, ...]``."""
    if tuple(tensor.shape[:2]) != (packed.batch_size, packed.seq_len):
        raise BatchError(
            f"pack_tensor: expected a tensor of shape [{packed.batch_size}, {packed.seq_len}, ...] "
            f"like the packed input_ids, got {tuple(tensor.shape)}."
        )
    flat = tensor.reshape(packed.batch_size * packed.seq_len, *tensor.shape[2:])
    return flat[packed.flat_indices.to(tensor.device)].unsqueeze(0)


def unpack(packed: PackedSequences, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Scatter packed ``values`` (``[1, T, ...]`` or ``[T, ...]``) back to ``[B, L, ...]``."""
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == packed.num_tokens:
        values = values[0]  # [1, T, ...] -> [T, ...]
    if values.shape[0] != packed.num_tokens:
        raise BatchError(
            f"unpack: expected values of shape [1, {packed.num_tokens}, ...] or "
            f"[{packed.num_tokens}, ...] (one per packed token), got {tuple(values.shape)}."
        )
    out = values.new_full((packed.batch_size * packed.seq_len, *values.shape[1:]), fill)
    out[packed.flat_indices.to(values.device)] = values
    return out.reshape(packed.batch_size, packed.seq_len, *values.shape[1:])


def sequence_start_mask(packed: PackedSequences) -> torch.Tensor:
    """``[1, T]`` bool, True at the first token of every sequence."""
    return packed.position_ids == 0
