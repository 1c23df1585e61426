"""A tiny mixture of experts and routes for it, for the conformance kit and the tests.

:data:`TINY_QWEN3_MOE` is a Qwen3-MoE of 8 experts, top-2, with an odd vocabulary, and
:data:`TINY_MIXTRAL` a Mixtral of other odd shapes and :data:`TINY_QWEN2_MOE` a Qwen2-MoE (a gated
shared expert beside the routed ones);
:func:`routed_batch` gives a batch of random sequences and routes a rollout could have chosen
for it (a bf16 copy's, with every third token sent one expert further, so they surely differ
from the model's own). The oracle is ``engine_core.testing.oracle.plain_log_probs`` with the routes:
each sequence alone through transformers with its routes replayed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.batch import ATTENTION_MASK, INPUT_IDS
from engine_core.moe import RouteRecorder, replaying
from engine_core.testing.models import random_batch

__all__ = [
    "AS_QWEN3_MOE",
    "TINY_MIXTRAL",
    "TINY_QWEN2_MOE",
    "TINY_QWEN3_MOE",
    "own_routes",
    "routes_per_sample",
    "routed_batch",
]

TINY_QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 67,
    "hidden_size": 48,
    "intermediate_size": 80,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
# the second family: no q/k norms, a router that always renormalises its top-k
TINY_MIXTRAL: dict[str, Any] = {
    "model_type": "mixtral",
    "vocab_size": 71,
    "hidden_size": 40,
    "intermediate_size": 40,  # bf16 grouped_mm: rows of a multiple of 16 bytes
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 10,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
# what turns a dense Qwen2-style config into a Qwen3-MoE of 8 experts, top-2 (head size 32):
# the shipped agent recipe's model as a mixture of experts, in the episode-routing tests
AS_QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "head_dim": 32,
}
# a shared-expert family: Qwen2-MoE's shared expert (its own width) on every token, scaled by a
# sigmoid gate, beside 8 routed experts whose top-2 probabilities are not renormalised; q/k/v
# biases, no q/k norms
TINY_QWEN2_MOE: dict[str, Any] = {
    "model_type": "qwen2_moe",
    "vocab_size": 69,
    "hidden_size": 48,
    "intermediate_size": 80,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 56,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def _rows(batch: TensorDict) -> list[torch.Tensor]:
    ids, mask = batch[INPUT_IDS], batch[ATTENTION_MASK].bool()
    return [ids[i][mask[i]].unsqueeze(0) for i in range(ids.shape[0])]


def routes_per_sample(
    model: Any, mask: torch.Tensor, forward: Callable[[int], Any]
) -> torch.Tensor:
    """The experts ``model``'s routers choose while ``forward(i)`` runs sample ``i`` alone,
    for each real token of ``mask`` ``[B, L]``: ``[B, L, layers, top_k]``, zeros on
    padding."""
    mask = mask.bool()
    out: torch.Tensor | None = None
    with torch.no_grad():
        for i in range(mask.shape[0]):
            with RouteRecorder(model) as rec:
                forward(i)
            chosen = rec.routes().transpose(0, 1)  # [tokens, layers, top_k]
            if out is None:
                out = torch.zeros(*mask.shape, *chosen.shape[1:], dtype=torch.int64)
            out[i, mask[i]] = chosen
    assert out is not None
    return out


def own_routes(model: Any, batch: TensorDict, routes: torch.Tensor | None = None) -> torch.Tensor:
    """The experts ``model``'s own routers choose for each real token of ``batch``
    (``[B, L, layers, top_k]``, zeros on padding), each sequence alone; with ``routes``, while
    those are replayed (each router's choice before the replay replaces it)."""
    mask = batch[ATTENTION_MASK].bool()
    rows = _rows(batch)

    def forward(i: int) -> None:
        if routes is None:
            model(rows[i])
            return
        with replaying(model, routes[i][mask[i]].transpose(0, 1)):
            model(rows[i])

    return routes_per_sample(model, mask, forward)


def routed_batch(model: Any, num_samples: int = 6) -> tuple[TensorDict, torch.Tensor]:
    """A left-padded batch of random lengths and routes for it, ``[B, L, layers, top_k]``
    (zeros on padding)."""
    batch = random_batch(num_samples, seq_len=16, seed=5, left_pad=True)
    sampler = copy.deepcopy(model).to(torch.bfloat16)
    routes = own_routes(sampler, batch)
    experts = int(model.config.num_experts)
    routes[:, ::3] = (routes[:, ::3] + 1) % experts
    return batch, routes
