"""``sdpa_varlen``: variable-length attention for packed rows with PyTorch's SDPA kernel.

transformers attends over a packed row with one dense ``[T, T]`` block-diagonal mask, so the
attention cost grows with the square of the whole row. Given the packed row's ``cu_seqlens``
(passed by the engine as ``cu_seq_lens_q``), this implementation runs causal SDPA on each
sequence of the row on its own — cost ``sum(L_i^2)``, no mask at all — the role flash-attention's
varlen kernel plays on GPUs. Sequences of similar lengths go through one batched causal SDPA
call padded to the longest of them (:func:`length_buckets`; the causal mask keeps every real
query off the padding), so a batch of many short sequences costs one or a few calls, and no
dense mask is built for a packed row (one row without a padding mask: a packed row must come with its
``cu_seq_lens_q``, as every packed call of ``BaseEngine`` does). Unpacked (padded) calls fall
back to transformers' SDPA with its usual mask. Select it with ``model.attn_implementation: sdpa_varlen``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine_core.context_parallel import CP_GROUP_ATTR, head_to_seq, seq_to_head

__all__ = ["SDPA_VARLEN", "length_buckets", "register_sdpa_varlen", "sdpa_varlen_attention"]

SDPA_VARLEN = "sdpa_varlen"

# A bucket of lengths runs as one call padded to its longest length while that costs at most
# this many times the attention of its sequences run at their own lengths.
MAX_PADDED_COST = 1.5


def length_buckets(lengths: list[int], max_cost: float = MAX_PADDED_COST) -> list[list[int]]:
    """Group the distinct sequence lengths of a packed row into kernel calls.

    Ascending, a length joins the current bucket while the bucket padded to it (``n * M^2``
    for ``n`` sequences of longest length ``M``) costs at most ``max_cost`` times the
    attention of its sequences at their own lengths (``sum L^2``): similar lengths share one
    call, very different ones keep their own. Returns the buckets' distinct lengths.
    """
    counts: dict[int, int] = {}
    for n in lengths:
        counts[n] = counts.get(n, 0) + 1
    buckets: list[list[int]] = []
    exact = members = 0
    for n in sorted(counts):
        c = counts[n]
        if buckets and n * n * (members + c) <= max_cost * (exact + c * n * n):
            buckets[-1].append(n)
            exact, members = exact + c * n * n, members + c
        else:
            buckets.append([n])
            exact, members = c * n * n, c
    return buckets


@torch.compiler.disable  # lengths drive Python control flow: eager inside compiled blocks
def sdpa_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Per-sequence causal attention over one packed row (``query``: ``[1, H, T, D]``).

    Under context parallelism (the layer holds a group, :mod:`engine_core.context_parallel`)
    the row's tokens are split over the group: the heads are spread over it for the attention
    of whole sequences, then the tokens again."""
    group = getattr(module, CP_GROUP_ATTR, None)
    if group is not None and cu_seq_lens_q is not None:
        q, k, v = (seq_to_head(x, group) for x in (query, key, value))
        out, _ = _varlen_attention(
            module, q, k, v, attention_mask, dropout, scaling, cu_seq_lens_q, **kwargs
        )
        # out: [1, T, heads/cp, D], contiguous; back to [1, T/cp, heads, D] (contiguous too)
        return head_to_seq(out.transpose(1, 2), group).transpose(1, 2).contiguous(), None
    return _varlen_attention(
        module, query, key, value, attention_mask, dropout, scaling, cu_seq_lens_q, **kwargs
    )


def _varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    cu_seq_lens_q: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None or query.shape[0] != 1 or kwargs.get("sliding_window") is not None:
        # padded input, or a sliding window this path does not implement: plain SDPA + mask
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    gqa = key.shape[1] != query.shape[1]
    heads, dim, row = query.shape[1], query.shape[3], query.shape[2]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
        )  # [n, H, M, D]

    cu = cu_seq_lens_q.to(query.device)
    lengths = cu[1:] - cu[:-1]
    nonempty = lengths[lengths > 0].tolist()
    if len(set(nonempty)) == 1 and len(nonempty) * nonempty[0] == row:
        # every sequence has one length (a single sequence, say): the row is its sequences
        # one after the other, so the kernel reads views of it and its result is the output
        # (no gather and no scatter, in the forward or the backward)
        block = attend(*(_split(x, len(nonempty)) for x in (query, key, value)))
        return block.transpose(1, 2).reshape(1, row, heads, dim).contiguous(), None
    # [1, H, T, D] in the layout of query (token-major as transformers' projections give it,
    # so the [1, T, H, D] returned below needs no copy); every position belongs to one sequence
    out = torch.empty_like(query)
    last = row - 1
    # one batched call per bucket of lengths: [n, h, M, D] with M the bucket's longest length
    for bucket in length_buckets(nonempty):
        chosen = (lengths[:, None] == torch.tensor(bucket, device=cu.device)).any(-1)
        starts, lens, longest = cu[:-1][chosen], lengths[chosen], max(bucket)
        # a shorter sequence reads past its end into whatever follows (clamped to the row):
        # under the causal mask no real query attends to those keys, and their outputs are
        # dropped below, so neither the result nor the gradient sees them
        at = (starts[:, None] + torch.arange(longest, device=cu.device)).clamp_(max=last).flatten()
        block = attend(*(_gather(x, at, len(starts)) for x in (query, key, value)))
        flat = block.transpose(0, 1).reshape(1, heads, -1, dim)
        # in place: an out-of-place index_copy would copy the whole row's output per bucket;
        # under autocast the kernel's output may be narrower than the row's (the out-of-place
        # index_copy promoted it), so it is cast to the row's dtype
        if len(bucket) == 1:  # one length: every position is real
            out.index_copy_(2, at, flat.to(out.dtype))
        else:
            real = (torch.arange(longest, device=cu.device) < lens[:, None]).flatten()
            keep = real.nonzero().squeeze(-1)
            out.index_copy_(2, at[keep], flat.index_select(2, keep).to(out.dtype))
    return out.transpose(1, 2).contiguous(), None  # [1, T, H, D], as transformers expects


def _gather(x: torch.Tensor, at: torch.Tensor, n: int) -> torch.Tensor:
    """Positions ``at`` of a packed ``[1, h, T, D]`` as ``[n, h, M, D]`` (``n * M`` of them)."""
    return _split(x.index_select(2, at), n)


def _split(x: torch.Tensor, n: int) -> torch.Tensor:
    """A packed ``[1, h, n * M, D]`` as ``[n, h, M, D]``, a view (whatever its layout)."""
    return x.view(x.shape[1], n, -1, x.shape[3]).transpose(0, 1)


def register_sdpa_varlen() -> None:
    """Make ``attn_implementation='sdpa_varlen'`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SDPA_VARLEN, sdpa_varlen_attention)
    AttentionMaskInterface.register(SDPA_VARLEN, _mask_unless_packed)


def _mask_unless_packed(
    batch_size: int, *args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any
) -> Any:
    """SDPA's mask for padded calls; none for a packed row (one row, no padding mask): the
    attention above runs each of its sequences causally from ``cu_seq_lens``, and building the
    row's dense ``[T, T]`` block-diagonal mask would cost more than the attention itself."""
    from transformers.masking_utils import sdpa_mask

    if batch_size == 1 and attention_mask is None:
        return None
    kwargs["attention_mask"] = attention_mask
    return sdpa_mask(batch_size, *args, **kwargs)
