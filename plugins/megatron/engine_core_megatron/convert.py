"""Hugging Face ↔ megatron-core for Llama-, Qwen2- and Qwen3-family causal LMs, the Qwen3-MoE
and Mixtral mixtures of experts (and their value heads).

Three pieces, all plain tensor code (the engine does the collectives):

- :func:`transformer_config_kwargs` maps a transformers config to ``TransformerConfig``
  arguments and ``GPTModel`` arguments, refusing what the mapping does not cover;
- :func:`megatron_to_hf_names` names, for one megatron parameter, the HF tensors it holds;
- :func:`shard_from_hf` cuts this tensor-parallel rank's shard of a megatron parameter out of
  the full HF tensors, and :func:`hf_from_shards` rebuilds the full HF tensors from every
  rank's shards.

Layouts: megatron fuses Q, K and V into ``linear_qkv`` grouped by key/value head (for each
group: its query heads, then its key, then its value) and splits it over TP ranks by group;
``linear_fc1`` holds the gate and up projections, each split over TP ranks, as
``[gate shard; up shard]``; ``linear_proj`` and ``linear_fc2`` are split along their input
dimension, embeddings and the output layer along the (padded) vocabulary. Qwen3's per-head
RMSNorms of queries and keys (``q_norm`` / ``k_norm``, one ``head_dim`` weight each, shared by
every head) are megatron-core's ``q_layernorm`` / ``k_layernorm``, replicated over TP ranks.

Mixtures of experts (every decoder layer an MoE layer, no shared expert): transformers holds a
layer's experts stacked, ``mlp.experts.gate_up_proj`` ``[experts, 2 * ffn, hidden]`` (each
expert's gate rows, then its up rows) and ``mlp.experts.down_proj`` ``[experts, hidden, ffn]``,
and its router as ``mlp.gate.weight``. megatron-core holds the router as ``mlp.router.weight``
(replicated) and each expert parallel rank its own experts as
``mlp.experts.local_experts.<i>.linear_fc1`` / ``linear_fc2`` (global expert
``ep_rank * experts_per_rank + i``), whole (the engine sets no expert tensor parallelism;
``linear_fc1`` is ``[gate; up]``).
The export names ``mlp.experts.linear_fc1.weight`` / ``linear_fc2.weight`` stand for every expert
of a layer at once (the stacked HF tensor). Routers: a softmax over every expert then the top-k
(``norm_topk_prob: false``) is megatron-core's ``moe_router_pre_softmax``; top-k probabilities
renormalised over the chosen experts (``norm_topk_prob: true``, Mixtral) are its top-k of the
logits followed by a softmax over them, the same numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from engine_core.backend import (
    ConfigError,
)

__all__ = [
    "ModelLayout",
    "SUPPORTED_MODEL_TYPES",
    "UNFUSED",
    "QK_NORM_MODEL_TYPES",
    "layer_parts",
    "transformer_config_kwargs",
    "megatron_to_hf_names",
    "shard_from_hf",
    "hf_from_shards",
    "hf_parameter_names",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
# model types whose attention normalises queries and keys per head before the rotary embedding
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")


@dataclass(frozen=True)
class ModelLayout:
    """The shape facts the mapping needs, read from the transformers config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_groups: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    padded_vocab_size: int
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    value_head: bool
    num_experts: int = 0  # 0: a dense model
    top_k: int = 0
    expert_ffn_size: int = 0
    normalize_top_k: bool = False  # the chosen experts' probabilities renormalised to sum 1
    expert_parallel: int = 1
    # Qwen2-MoE's shared expert, on every token beside the routed ones and scaled by a sigmoid
    # gate of its own: its MLP width (0: none)
    shared_ffn_size: int = 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_groups

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.expert_parallel


def _rope_theta(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    scaling = getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ConfigError(
            f"megatron: rope_type={kind!r} is not mapped to megatron-core yet; supported: "
            f"'default' rotary embeddings. Use the fsdp2 engine for this model."
        )
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def _moe_facts(hf: Any, model_type: str, ep: int) -> dict[str, Any]:
    """The router and expert facts of a mixture of experts, checked against ``ep``."""
    if model_type == "mixtral":
        experts, ffn, normalize = hf.num_local_experts, hf.intermediate_size, True
        if getattr(hf, "sliding_window", None) is not None:
            raise ConfigError(
                f"megatron: sliding_window={hf.sliding_window} is not mapped (megatron-core's "
                f"local attention is full causal); set sliding_window: null or use fsdp2."
            )
        if float(getattr(hf, "router_jitter_noise", 0.0) or 0.0):
            raise ConfigError("megatron: router_jitter_noise > 0 is not mapped; set it to 0.")
    else:
        family = "Qwen2-MoE" if model_type == "qwen2_moe" else "Qwen3-MoE"
        experts, ffn = hf.num_experts, hf.moe_intermediate_size
        normalize = bool(getattr(hf, "norm_topk_prob", False))
        sparse = getattr(hf, "decoder_sparse_step", 1)
        dense = list(getattr(hf, "mlp_only_layers", None) or [])
        if sparse != 1 or dense:
            raise ConfigError(
                f"megatron: a {family} with dense layers (decoder_sparse_step={sparse}, "
                f"mlp_only_layers={dense}) is not mapped; every layer must be an MoE layer "
                f"(decoder_sparse_step: 1, mlp_only_layers: []). Use fsdp2 for this model."
            )
        kinds = sorted(set(getattr(hf, "layer_types", None) or []) - {"full_attention"})
        if model_type == "qwen2_moe" and (getattr(hf, "use_sliding_window", False) or kinds):
            raise ConfigError(
                f"megatron: a Qwen2-MoE with a sliding window (use_sliding_window="
                f"{str(bool(getattr(hf, 'use_sliding_window', False))).lower()}, layer_types "
                f"{kinds or ['full_attention']}) is not mapped (megatron-core's local attention "
                f"is full causal); set use_sliding_window: false and every layer_types entry to "
                f"full_attention, or use fsdp2."
            )
    if experts % ep:
        raise ConfigError(
            f"megatron: expert_parallel_size={ep} must divide the number of experts "
            f"({experts}); choose a divisor of it."
        )
    shared = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)
    if model_type == "qwen2_moe" and not shared:
        raise ConfigError(
            "megatron: a Qwen2-MoE needs shared_expert_intermediate_size > 0 (its shared "
            "expert); got 0."
        )
    return {
        "shared_ffn_size": shared if model_type == "qwen2_moe" else 0,
        "num_experts": int(experts),
        "top_k": int(hf.num_experts_per_tok),
        "expert_ffn_size": int(ffn),
        "normalize_top_k": normalize,
        "expert_parallel": ep,
    }


def layout_of(hf: Any, *, value_head: bool, tp: int, ep: int = 1) -> ModelLayout:
    """Read the mapping's facts from ``hf`` and check them against ``tp`` and ``ep`` (expert
    parallel size)."""
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"megatron: model_type {model_type!r} has no megatron-core mapping; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}. Use the fsdp2 engine for other architectures."
        )
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ConfigError(f"megatron: hidden_act {hf.hidden_act!r} is not mapped; expected 'silu'.")
    if getattr(hf, "mlp_bias", False):
        raise ConfigError("megatron: mlp_bias=true is not mapped; expected false.")
    heads = hf.num_attention_heads
    groups = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    if groups % tp or heads % tp:
        raise ConfigError(
            f"megatron: tensor_parallel_size={tp} must divide num_attention_heads ({heads}) and "
            f"num_key_value_heads ({groups}); choose a divisor of both."
        )
    moe = _moe_facts(hf, model_type, ep) if model_type in MOE_MODEL_TYPES else {}
    if not moe and ep > 1:
        raise ConfigError(
            f"megatron: expert_parallel_size={ep} needs a mixture-of-experts model; "
            f"{model_type!r} is dense. Set expert_parallel_size: 1."
        )
    if moe.get("shared_ffn_size", 0) % tp:
        raise ConfigError(
            f"megatron: tensor_parallel_size={tp} must divide shared_expert_intermediate_size "
            f"({moe['shared_ffn_size']}), which is cut over the TP ranks."
        )
    if not moe and hf.intermediate_size % tp:
        raise ConfigError(
            f"megatron: tensor_parallel_size={tp} must divide intermediate_size "
            f"({hf.intermediate_size})."
        )
    vocab = hf.vocab_size
    padded = -(-vocab // tp) * tp
    qkv_bias = (
        model_type == "qwen2"
        or (model_type == "qwen2_moe" and bool(getattr(hf, "qkv_bias", True)))
        or bool(getattr(hf, "attention_bias", False))
    )
    return ModelLayout(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_heads=heads,
        num_groups=groups,
        head_dim=head_dim,
        ffn_size=hf.intermediate_size,
        vocab_size=vocab,
        padded_vocab_size=padded,
        qkv_bias=qkv_bias,
        qk_norm=model_type in QK_NORM_MODEL_TYPES,
        tied=bool(getattr(hf, "tie_word_embeddings", False)) and not value_head,
        value_head=value_head,
        **moe,
    )


# megatron-core fusions that need its CUDA extensions, TransformerEngine or Apex: off, so that
# the local layers run on any device and equal transformers' arithmetic
UNFUSED: dict[str, bool] = {
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
    "cross_entropy_loss_fusion": False,
}


def transformer_config_kwargs(
    hf: Any, layout: ModelLayout
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``TransformerConfig`` kwargs, ``GPTModel`` kwargs) for the model described by ``hf``."""
    config = {
        "num_layers": layout.num_layers,
        "hidden_size": layout.hidden_size,
        "ffn_hidden_size": layout.ffn_size,
        "num_attention_heads": layout.num_heads,
        "num_query_groups": layout.num_groups,
        "kv_channels": layout.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf.rms_norm_eps),
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": layout.qkv_bias,
        "qk_layernorm": layout.qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": float(getattr(hf, "attention_dropout", 0.0) or 0.0),
        "init_method_std": float(getattr(hf, "initializer_range", 0.02)),
    }
    model = {
        "vocab_size": layout.padded_vocab_size,
        "max_sequence_length": int(hf.max_position_embeddings),
        "position_embedding_type": "rope",
        "rotary_base": _rope_theta(hf),
        "share_embeddings_and_output_weights": layout.tied,
    }
    if layout.moe:
        config.update(
            num_moe_experts=layout.num_experts,
            moe_router_topk=layout.top_k,
            moe_ffn_hidden_size=layout.expert_ffn_size,
            moe_router_pre_softmax=not layout.normalize_top_k,
            # the load-balancing loss goes through the engine's loss contract (moe_aux), not
            # megatron-core's own accounting
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,  # SequentialMLP: each expert its own local MLP
            expert_model_parallel_size=layout.expert_parallel,
            # each expert whole on its rank: the dispatcher's uneven gathers over expert TP
            # ranks need NCCL, and small experts gain little from being cut
            expert_tensor_parallel_size=1,
        )
    if layout.shared_ffn_size:  # cut over the TP ranks as a dense MLP is
        config.update(
            moe_shared_expert_intermediate_size=layout.shared_ffn_size,
            moe_shared_expert_gate=True,  # sigmoid(x . gate_weight) times its output
            moe_shared_expert_overlap=False,
        )
    return config, model


def layer_parts(layout: ModelLayout) -> list[str]:
    """The megatron parameters of one decoder layer (local names after ``decoder.layers.N.``),
    in the order transformers lists their HF tensors."""
    return [
        "self_attention.linear_qkv.weight",
        *(["self_attention.linear_qkv.bias"] if layout.qkv_bias else []),
        "self_attention.linear_proj.weight",
        *(
            ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
            if layout.qk_norm
            else []
        ),
        *(
            ["mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight", "mlp.router.weight"]
            if layout.moe
            else ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
        ),
        *(
            [
                "mlp.shared_experts.linear_fc1.weight",
                "mlp.shared_experts.linear_fc2.weight",
                "mlp.shared_experts.gate_weight",
            ]
            if layout.shared_ffn_size
            else []
        ),
        "input_layernorm.weight",
        "pre_mlp_layernorm.weight",
    ]


def hf_parameter_names(layout: ModelLayout) -> list[str]:
    """Every HF parameter name of the model, layer by layer."""
    names = ["model.embed_tokens.weight"]
    for i in range(layout.num_layers):
        for part in layer_parts(layout):
            names += megatron_to_hf_names(f"decoder.layers.{i}.{part}", 0, layout)
    names.append("model.norm.weight")
    if layout.value_head:
        names += ["score.weight", "score.bias"]
    elif not layout.tied:
        names.append("lm_head.weight")
    return names


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LAYER_PARTS = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": tuple(f"self_attn.{x}_proj.weight" for x in "qkv"),
    "self_attention.linear_qkv.bias": tuple(f"self_attn.{x}_proj.bias" for x in "qkv"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
    "mlp.router.weight": ("mlp.gate.weight",),
    "mlp.experts.linear_fc1.weight": ("mlp.experts.gate_up_proj",),
    "mlp.experts.linear_fc2.weight": ("mlp.experts.down_proj",),
    "mlp.shared_experts.linear_fc1.weight": (
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
    ),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_expert.down_proj.weight",),
    "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight",),
}
# one expert of an expert-parallel rank: its part of the layer's stacked expert tensor
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_GLOBAL = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight",),
    "decoder.final_layernorm.weight": ("model.norm.weight",),
    "output_layer.weight": ("lm_head.weight",),
}
_VALUE_HEAD = {"output_layer.weight": ("score.weight",), "output_layer.bias": ("score.bias",)}


def megatron_to_hf_names(name: str, layer_offset: int, layout: ModelLayout) -> tuple[str, ...]:
    """The HF tensors one megatron parameter (local name, layers offset by ``layer_offset``) holds."""
    m = _LAYER.match(name)
    if m:
        local, rest = int(m.group(1)), m.group(2)
        expert = _LOCAL_EXPERT.match(rest)
        if expert:
            rest = f"mlp.experts.{expert.group(2)}"
        if rest not in _LAYER_PARTS:
            raise KeyError(f"megatron parameter {name!r} has no HF mapping")
        return tuple(f"model.layers.{layer_offset + local}.{part}" for part in _LAYER_PARTS[rest])
    if layout.value_head and name in _VALUE_HEAD:
        return _VALUE_HEAD[name]
    if name == "output_layer.weight" and layout.tied:
        return ("model.embed_tokens.weight",)
    if name not in _GLOBAL:
        raise KeyError(f"megatron parameter {name!r} has no HF mapping")
    return _GLOBAL[name]


def local_expert(name: str) -> int | None:
    """The local expert index of a megatron expert parameter (``...local_experts.<i>...``)."""
    m = _LAYER.match(name)
    expert = _LOCAL_EXPERT.match(m.group(2)) if m else None
    return int(expert.group(1)) if expert else None


def _kind(name: str, layout: ModelLayout) -> str:
    if layout.value_head and name.startswith("output_layer."):
        return "replicated"  # the value head is replicated over TP ranks
    for suffix, kind in (
        ("linear_qkv.weight", "qkv"),
        ("linear_qkv.bias", "qkv"),
        ("linear_fc1.weight", "fc1"),
        ("linear_proj.weight", "row"),
        ("linear_fc2.weight", "row"),
        ("word_embeddings.weight", "vocab"),
        ("output_layer.weight", "vocab"),
    ):
        if name.endswith(suffix):
            return kind
    return "replicated"


def shard_from_hf(
    name: str,
    hf: tuple[torch.Tensor, ...],
    layout: ModelLayout,
    tp_rank: int,
    tp: int,
    ep_rank: int = 0,
) -> torch.Tensor:
    """This TP rank's shard of megatron parameter ``name`` from its full HF tensors (an expert's:
    of this expert-parallel rank's expert, cut over the expert TP ranks ``tp_rank`` of ``tp``)."""
    expert = local_expert(name)
    if expert is not None:  # this rank's expert out of the layer's stacked experts
        full = hf[0][ep_rank * layout.experts_per_rank + expert]
        hf = tuple(full.chunk(2, dim=0)) if name.endswith("linear_fc1.weight") else (full,)
    kind = _kind(name, layout)
    if kind == "replicated":
        return hf[0]
    if kind == "row":
        return hf[0].chunk(tp, dim=1)[tp_rank]
    if kind == "vocab":
        full = hf[0]
        if layout.padded_vocab_size > full.shape[0]:
            pad = full.new_zeros(layout.padded_vocab_size - full.shape[0], *full.shape[1:])
            full = torch.cat([full, pad])
        return full.chunk(tp, dim=0)[tp_rank]
    if kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])
    # qkv: per group [its query heads, its key, its value], groups split over TP ranks
    q, k, v = hf
    g, r, d = layout.num_groups, layout.heads_per_group, layout.head_dim
    tail = q.shape[1:]
    fused = torch.cat(
        [q.reshape(g, r * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1
    )
    return fused.chunk(tp, dim=0)[tp_rank].reshape(-1, *tail)


def hf_from_shards(
    name: str, shards: list[torch.Tensor], layout: ModelLayout
) -> tuple[torch.Tensor, ...]:
    """The full HF tensors of megatron parameter ``name`` from every TP rank's shard (in order)."""
    kind = _kind(name, layout)
    if kind == "replicated":
        return (shards[0],)
    if kind == "row":
        return (torch.cat(shards, dim=1),)
    if kind == "vocab":
        return (torch.cat(shards, dim=0)[: layout.vocab_size],)
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
    g, r, d = layout.num_groups, layout.heads_per_group, layout.head_dim
    tail = shards[0].shape[1:]
    fused = torch.cat(shards).reshape(g, (r + 2) * d, *tail)
    q, k, v = fused.split([r * d, d, d], dim=1)
    return q.reshape(g * r * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail)
