"""``sdpa_varlen``: variable-length attention for packed rows with PyTorch's SDPA kernel.

transformers attends over a packed row with one dense ``[T, T]`` block-diagonal mask, so the
attention cost grows with the square of the whole row. Given the packed row's ``cu_seqlens``
(passed by the engine as ``cu_seq_lens_q``), this implementation runs causal SDPA on each
sequence of the row on its own — cost ``sum(L_i^2)``, no mask at all — the role flash-attention's
varlen kernel plays on GPUs. Sequences of the same length go through one batched SDPA call, so
a batch of many short sequences costs as many calls as it has distinct lengths, and no dense
mask is built for a packed row (one row without a padding mask: a packed row must come with its
``cu_seq_lens_q``, as every packed call of ``BaseEngine`` does). Unpacked (padded) calls fall
back to transformers' SDPA with its usual mask. Select it with ``model.attn_implementation: sdpa_varlen``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["SDPA_VARLEN", "register_sdpa_varlen", "sdpa_varlen_attention"]

SDPA_VARLEN = "sdpa_varlen"


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
    """Per-sequence causal attention over one packed row (``query``: ``[1, H, T, D]``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None or query.shape[0] != 1 or kwargs.get("sliding_window") is not None:
        # padded input, or a sliding window this path does not implement: plain SDPA + mask
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    gqa = key.shape[1] != query.shape[1]
    cu = cu_seq_lens_q.to(query.device)
    lengths = cu[1:] - cu[:-1]
    out = torch.empty_like(query)  # [1, H, T, D]; every position belongs to one sequence
    # the sequences of one length go through one batched call: as many calls as lengths
    for length in torch.unique(lengths[lengths > 0]).tolist():
        starts = cu[:-1][lengths == length]
        at = (starts[:, None] + torch.arange(length, device=cu.device)).flatten()

        def gather(x: torch.Tensor, at: torch.Tensor = at, n: int = len(starts)) -> torch.Tensor:
            # [1, h, n * L, D] -> [n, h, L, D]
            return x.index_select(2, at).view(x.shape[1], n, -1, x.shape[3]).transpose(0, 1)

        block = F.scaled_dot_product_attention(
            gather(query),
            gather(key),
            gather(value),
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )  # [n, H, L, D]
        flat = block.transpose(0, 1).reshape(1, query.shape[1], -1, query.shape[3])
        out = out.index_copy(2, at, flat)
    return out.transpose(1, 2).contiguous(), None  # [1, T, H, D], as transformers expects


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
