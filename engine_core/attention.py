"""``sdpa_varlen``: variable-length attention for packed rows with PyTorch's SDPA kernel.

transformers attends over a packed row with one dense ``[T, T]`` block-diagonal mask, so the
attention cost grows with the square of the whole row. Given the packed row's ``cu_seqlens``
(passed by the engine as ``cu_seq_lens_q``), this implementation runs causal SDPA on each
sequence of the row on its own — cost ``sum(L_i^2)``, no mask at all — the role flash-attention's
varlen kernel plays on GPUs. Unpacked (padded) calls fall back to transformers' SDPA with its
usual mask. Select it with ``model.attn_implementation: sdpa_varlen``.
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
    bounds = cu_seq_lens_q.tolist()
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)
        if e > s
    ]
    out = torch.cat(outs, dim=2)  # [1, H, T, D]
    return out.transpose(1, 2).contiguous(), None  # [1, T, H, D], as transformers expects


def register_sdpa_varlen() -> None:
    """Make ``attn_implementation='sdpa_varlen'`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SDPA_VARLEN, sdpa_varlen_attention)
    # padded calls need SDPA's mask; packed calls ignore it
    AttentionMaskInterface.register(SDPA_VARLEN, sdpa_mask)
