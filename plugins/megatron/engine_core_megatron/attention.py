"""Core attention on PyTorch's SDPA, for megatron-core's local layer spec, padded or packed.

megatron-core's own local ``DotProductAttention`` refuses packed (THD) input; its packed path
needs TransformerEngine. :class:`SDPACoreAttention` takes its place in the layer spec and runs
on any device: padded input ``[s, b, heads, dim]`` with a causal mask combined with the
key-padding mask, or packed input ``[t, heads, dim]`` as one causal SDPA call per sequence of
``packed_seq_params.cu_seqlens_q``. Rotary embeddings stay megatron-core's (per sequence for
packed input).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

__all__ = ["SDPACoreAttention"]


class SDPACoreAttention(MegatronModule):
    """A drop-in ``core_attention`` module (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        tp = pg_collection.tp.size() if pg_collection is not None else 1
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        gqa = self.heads != self.groups
        if packed_seq_params is not None:
            # [t, heads, dim]: one causal call per packed sequence
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            outs = [
                F.scaled_dot_product_attention(
                    q[:, :, s:e],
                    k[:, :, s:e],
                    v[:, :, s:e],
                    dropout_p=p,
                    is_causal=True,
                    scale=self.scale,
                    enable_gqa=gqa,
                )
                for s, e in zip(bounds[:-1], bounds[1:], strict=True)
                if e > s
            ]
            out = torch.cat(outs, dim=2)[0].transpose(0, 1)  # [t, heads, dim]
            return out.reshape(out.shape[0], -1)
        # [s, b, heads, dim] -> [b, heads, s, dim]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        s = q.shape[2]
        if attention_mask is None:  # causal only: the kernels' own causal path, no mask tensor
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=True, scale=self.scale, enable_gqa=gqa
            )
        else:
            # attention_mask: [b, 1, 1, s], True where the key is padding; padding queries
            # would attend to nothing (NaN), so they see themselves
            allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            allowed = allowed & ~attention_mask.bool()
            allowed = allowed | torch.eye(s, dtype=torch.bool, device=q.device)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=p, scale=self.scale, enable_gqa=gqa
            )
        b = out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads * dim]
