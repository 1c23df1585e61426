"""Context parallelism (Ulysses): one packed row of tokens split over the ranks of a group.

Each of the ``cp`` ranks of a context-parallel group holds a contiguous ``1/cp`` of the packed
row (its token ids, their per-sequence position ids, the ids that follow them). Everything in a
decoder block but attention works token by token, so it runs on the local slice unchanged.
Attention needs whole sequences: around it, one all-to-all turns ``[heads, T/cp]`` (every head,
the local tokens) into ``[heads/cp, T]`` (a ``1/cp`` of the heads, every token), attention runs
per sequence on whole rows with the row's ``cu_seqlens``, and a second all-to-all turns the
result back (:func:`seq_to_head`, :func:`head_to_seq`). After the model, the per-token results
(log-probs, entropy, values) are gathered into the whole row (:func:`gather_sequence`).

The number of heads and of key/value heads must divide by ``cp``. The row is padded to a
multiple of ``cp`` by one extra sequence of padding, which attends only to itself and whose
results are dropped (:func:`shard_row`).

Gradients: every rank of the group computes the loss of the whole row from the gathered
results, so the gathered tensor's gradient is the same on each; its backward sums it over the
group (an all-reduce) and keeps the local slice, so the group's summed parameter gradients are
``cp`` times the row's. An engine whose gradient reduction averages over the data-parallel and
context-parallel ranks together (FSDP over ``dp x cp``) thereby gets the data-parallel sum it
gets without context parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CP_GROUP_ATTR",
    "SequenceShard",
    "gather_sequence",
    "head_to_seq",
    "seq_to_head",
    "shard_row",
]

#: the attribute of an attention layer holding its context-parallel group (absent: none)
CP_GROUP_ATTR = "engine_core_cp_group"


class _AllToAll(torch.autograd.Function):
    """:func:`seq_to_head` (``to_heads``) or :func:`head_to_seq`; the backward is the other."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, to_heads: bool
    ) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_head if to_heads else _head_to_seq)(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return (_head_to_seq if ctx.to_heads else _seq_to_head)(grad, ctx.group), None, None


# Both directions exchange token-major blocks ``[b, tokens, heads, d]``, the layout of the
# attention layer's projections and of its output: for one row (``b == 1``) a rank's received
# tokens of its heads are already the whole row in order (no concatenation), and the output's
# slices to send are already contiguous (no staging copy). Each direction copies once.


def _exchange(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``send[i]`` to rank ``i``; the result's ``[i]`` came from rank ``i``."""
    received = torch.empty_like(send, memory_format=torch.contiguous_format)
    dist.all_to_all_single(received, send, group=group)
    return received


def _seq_to_head(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    b, heads, local, d = x.shape
    # [world, b, T/cp, heads/cp, d]: block i holds the local tokens of rank i's heads
    send = x.reshape(b, world, heads // world, local, d).permute(1, 0, 3, 2, 4)
    received = _exchange(send.contiguous(), group)
    # block i holds rank i's tokens: in rank order, the whole row (a view for b == 1)
    row = received.transpose(0, 1).reshape(b, world * local, heads // world, d)
    return row.transpose(1, 2)


def _head_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    b, heads, length, d = x.shape
    # [world, b, T/cp, heads/cp, d]: block i holds rank i's tokens (a view of a contiguous
    # [b, T, heads/cp, d] for b == 1)
    send = x.transpose(1, 2).reshape(b, world, length // world, heads, d).transpose(0, 1)
    received = _exchange(send.contiguous(), group)
    # block i holds rank i's heads of the local tokens: [b, T/cp, heads, d], token-major
    local = received.permute(1, 2, 0, 3, 4).contiguous().view(b, length // world, -1, d)
    return local.transpose(1, 2)


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[b, heads, T/cp, d]`` (every head, the local tokens) to ``[b, heads/cp, T, d]``.

    The result is a transposed view of a token-major ``[b, T, heads/cp, d]``."""
    return _AllToAll.apply(x, group, True)


def head_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[b, heads/cp, T, d]`` back to ``[b, heads, T/cp, d]``.

    The result is a transposed view of a contiguous ``[b, T/cp, heads, d]``; the exchange
    sends without a staging copy when ``x`` is such a view of a contiguous ``[1, T, heads/cp,
    d]``."""
    return _AllToAll.apply(x, group, False)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(world, dim=1)[rank], None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole row ``[b, T, ...]`` from each rank's ``[b, T/cp, ...]`` slice, differentiably
    (the backward sums the gradient over the group and keeps this rank's slice)."""
    return _GatherSequence.apply(x, group)


@dataclass
class SequenceShard:
    """Where this rank's slice sits in the packed row: ``length`` real tokens, padded to
    ``padded`` (a multiple of the group's size), of which this rank holds
    ``[start, start + padded // size)``."""

    group: dist.ProcessGroup
    rank: int
    size: int
    length: int
    padded: int

    @property
    def start(self) -> int:
        return self.rank * (self.padded // self.size)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a ``[b, padded, ...]`` row."""
        step = self.padded // self.size
        return x[:, self.start : self.start + step]


def shard_row(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup,
) -> tuple[SequenceShard, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad one packed row ``[1, T]`` to a multiple of the group's size with one extra sequence
    of padding (id 0, positions from 0) and return this rank's slice layout, the padded row's
    ids and positions, the next id at each of its positions, and its ``cu_seqlens``."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    length = int(input_ids.shape[1])
    extra = -length % size
    if extra:
        input_ids = torch.nn.functional.pad(input_ids, (0, extra))
        pad_pos = torch.arange(extra, dtype=position_ids.dtype, device=position_ids.device)
        position_ids = torch.cat([position_ids, pad_pos[None]], dim=1)
        end = cu_seqlens[-1:] + extra
        cu_seqlens = torch.cat([cu_seqlens, end])
    targets = torch.nn.functional.pad(input_ids[:, 1:], (0, 1))
    shard = SequenceShard(group, rank, size, length, length + extra)
    return shard, input_ids, position_ids, targets, cu_seqlens
