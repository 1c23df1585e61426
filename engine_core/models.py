"""Building transformers models from a :class:`~engine_core.config.ModelConfig`.

Shared by every engine that trains Hugging Face models: causal LMs for actors and references,
image-text-to-text models for vision-language ones (the class comes from the config,
:func:`model_class`), token-classification models with one label as value heads for critics.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from engine_core.attention import SDPA_VARLEN, register_sdpa_varlen
from engine_core.config import LoraConfig, ModelConfig
from engine_core.errors import ConfigError
from engine_core.moe import checkpoint_contexts, routers

__all__ = [
    "DTYPES",
    "build_hf_config",
    "build_model",
    "model_class",
    "apply_lora",
    "is_adapter_name",
    "merged_lora_tensors",
    "checkpoint_tensors",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def build_hf_config(cfg: ModelConfig) -> Any:
    """The transformers ``PretrainedConfig`` for ``cfg`` (loaded from the folder or built)."""
    from transformers import AutoConfig

    if cfg.path is not None:
        _require_saved_model(cfg.path)
        hf_config = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    else:
        kwargs = dict(cfg.config or {})
        model_type = kwargs.pop("model_type")
        try:
            hf_config = AutoConfig.for_model(model_type, **kwargs)
        except ValueError as e:
            raise ConfigError(f"model.config: cannot build a {model_type!r} config: {e}") from e
    if cfg.value_head:
        hf_config.num_labels = 1
        if getattr(hf_config, "classifier_dropout", None) is None:
            # transformers' token-classification head defaults to dropout 0.1; a value function
            # or reward model trained with it sees noisy targets that depend on the RNG layout
            hf_config.classifier_dropout = 0.0
    return hf_config


def _require_saved_model(path: str) -> None:
    """``model.path`` must be a local folder holding a saved model (nothing is downloaded)."""
    from pathlib import Path

    folder = Path(path)
    if not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "holds no config.json"
        raise ConfigError(
            f"model.path {path!r} {what}: it must be a local folder written by "
            f"save_pretrained() (config.json and the weights); nothing is downloaded. Pass "
            f"such a folder, or model.config to build the model from a config."
        )


def build_model(
    cfg: ModelConfig, *, device: torch.device | str = "cpu", load_weights: bool = True
) -> nn.Module:
    """Build (from config) or load (from ``cfg.path``) the model in ``cfg.dtype`` on ``device``.

    ``load_weights=False`` only builds the architecture (randomly initialised, left where it was
    created): the way to get a skeleton under a meta-device context.
    """
    dtype = DTYPES[cfg.dtype]
    hf_config = build_hf_config(cfg)
    auto = model_class(cfg, hf_config)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation is not None:
        if cfg.attn_implementation == SDPA_VARLEN:
            register_sdpa_varlen()
        kwargs["attn_implementation"] = cfg.attn_implementation
    model: Any
    if cfg.path is not None and load_weights:
        model, info = cast(
            tuple[Any, dict[str, Any]],
            auto.from_pretrained(cfg.path, config=hf_config, output_loading_info=True, **kwargs),
        )
        if cfg.value_head:
            _zero_missing_head_bias(model, info["missing_keys"])
    else:
        model = auto.from_config(hf_config, **kwargs)
    if load_weights:
        model = model.to(device)  # a transformers PreTrainedModel
    if cfg.gradient_checkpointing:
        options: dict[str, Any] = {"use_reentrant": False}
        if routers(model):  # replayed routes are replayed again when a block is recomputed
            options["context_fn"] = checkpoint_contexts
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    if cfg.lora is not None:
        model = apply_lora(model, cfg)
    return cast(nn.Module, model)


def model_class(cfg: ModelConfig, hf_config: Any) -> Any:
    """The transformers auto class that builds ``cfg``'s model, chosen by its config: a
    vision-language model (a config with a ``vision_config``) is an image-text-to-text model,
    a critic's (``value_head``) a token-classification model with one label, anything else a
    causal LM."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )

    from engine_core.vision import is_vision_config

    if is_vision_config(hf_config):
        if cfg.value_head:
            raise ConfigError(
                f"model.value_head: a value head on a vision-language model "
                f"({type(hf_config).__name__}) is not built here; train the critic on a text "
                f"model, or set value_head=false."
            )
        return AutoModelForImageTextToText
    return AutoModelForTokenClassification if cfg.value_head else AutoModelForCausalLM


def _zero_missing_head_bias(model: nn.Module, missing: list[str] | set[str]) -> None:
    """A sequence-classification checkpoint's score head has no bias; the value-head model's
    does. Zero it, so the loaded head computes exactly what the checkpoint's head computed."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in missing:
            if name.endswith("bias") and name.rsplit(".", 2)[0] == "score" and name in params:
                params[name].zero_()


def apply_lora(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """Wrap ``model`` with LoRA adapters; only adapter weights stay trainable."""
    assert cfg.lora is not None
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ImportError(
            "model.lora needs the 'peft' package, which is not installed. "
            "Install it with: pip install 'peft>=0.21,<0.22'"
        ) from e
    task = "TOKEN_CLS" if cfg.value_head else "CAUSAL_LM"
    lora = LoraConfig(
        r=cfg.lora.rank,
        # peft annotates lora_alpha as int but scales by alpha / r in float.
        lora_alpha=cfg.lora.alpha,  # type: ignore[arg-type]
        lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules,
        task_type=task,
    )
    return get_peft_model(model, lora)


_PEFT_PREFIX = "base_model.model."
_ADAPTER_PART = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` (a peft model's state-dict name) is a LoRA adapter tensor: the part of a
    LoRA model that trains, and all a sync to a rollout that serves the adapters has to send
    once it holds the base weights."""
    return _ADAPTER_PART.search(name) is not None


def peft_base_name(name: str) -> str:
    """The base model's HF name of a peft model's base tensor
    (``base_model.model.model.layers.0.mlp.up_proj.base_layer.weight`` ->
    ``model.layers.0.mlp.up_proj.weight``)."""
    return name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def adapted_modules(names: Iterable[str]) -> list[str]:
    """The module names (``q_proj``, ``down_proj``, ...) the adapter tensors among ``names``
    adapt: what a LoRA-serving backend is told to target (``all-linear`` as peft resolved it)."""
    return sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names if is_adapter_name(n)})


_LORA_PART = re.compile(
    r"^(?P<layer>.+)\.(?P<part>base_layer|lora_A\.default|lora_B\.default)\.(?P<kind>weight|bias)$"
)


def merged_lora_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], lora: LoraConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn a peft model's (name, full tensor) stream into the base model's HF names and weights.

    Each LoRA layer's weight is yielded merged (``W + alpha/rank * B @ A``) as soon as its three
    parts have arrived, so at most one layer is held; adapter-only entries disappear and
    ``modules_to_save`` copies replace the original modules. A rollout or an HF export then sees
    exactly the architecture it was built from.
    """
    scaling = lora.alpha / lora.rank
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for raw_name, tensor in tensors:
        name = raw_name.removeprefix(_PEFT_PREFIX)
        if ".original_module." in name:
            continue
        name = name.replace(".modules_to_save.default.", ".")
        m = _LORA_PART.match(name)
        if m is None:
            yield name, tensor
            continue
        layer, part, kind = m.group("layer"), m.group("part"), m.group("kind")
        if part == "base_layer" and kind == "bias":
            yield f"{layer}.bias", tensor
            continue
        got = parts.setdefault(layer, {})
        got[part] = tensor
        if len(got) == 3:
            del parts[layer]
            w, a, b = got["base_layer"], got["lora_A.default"], got["lora_B.default"]
            merged = w + scaling * (b.to(torch.float32) @ a.to(torch.float32)).to(w.dtype)
            yield f"{layer}.weight", merged
    if parts:
        raise RuntimeError(f"LoRA layers missing a part when merging: {sorted(parts)}")


def checkpoint_tensors(
    model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """``tensors`` (names and layout of ``model``'s state dict) as ``save_pretrained`` writes
    them: the checkpoint format other engines load. transformers holds some weights in another
    layout than its checkpoints (a mixture of experts' experts stacked in one tensor,
    ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, written as ``mlp.experts.{e}.gate_proj.weight``
    and ``up_proj.weight`` per expert); transformers' own reverse conversion makes the change, so
    a tensor comes back exactly as ``save_pretrained`` would write it. ``model`` may live on the
    meta device (only its config and class are read); each stacked tensor converts on its own,
    so a bucket of whole tensors converts alone."""
    from transformers.core_model_loading import revert_weight_conversion

    return list(revert_weight_conversion(cast(Any, model), dict(tensors)).items())
