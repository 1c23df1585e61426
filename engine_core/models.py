"""Building transformers models from a :class:`~engine_core.config.ModelConfig`.

Shared by every engine that trains Hugging Face models: causal LMs for actors and references,
token-classification models with one label as value heads for critics.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from engine_core.config import ModelConfig
from engine_core.errors import ConfigError

__all__ = ["DTYPES", "build_hf_config", "build_model", "apply_lora"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def build_hf_config(cfg: ModelConfig) -> Any:
    """The transformers ``PretrainedConfig`` for ``cfg`` (loaded from the folder or built)."""
    from transformers import AutoConfig

    if cfg.path is not None:
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
    return hf_config


def build_model(cfg: ModelConfig, *, device: torch.device | str = "cpu") -> nn.Module:
    """Build (from config) or load (from ``cfg.path``) the model in ``cfg.dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if cfg.value_head else AutoModelForCausalLM
    dtype = DTYPES[cfg.dtype]
    hf_config = build_hf_config(cfg)
    if cfg.path is not None:
        model = auto.from_pretrained(
            cfg.path, config=hf_config, dtype=dtype, trust_remote_code=cfg.trust_remote_code
        )
    else:
        model = auto.from_config(hf_config, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    model = cast(Any, model).to(device)  # a transformers PreTrainedModel
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora is not None:
        model = apply_lora(model, cfg)
    return cast(nn.Module, model)


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
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules,
        task_type=task,
    )
    return get_peft_model(model, lora)
