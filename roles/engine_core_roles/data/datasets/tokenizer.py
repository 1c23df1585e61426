"""The actor's tokenizer: read from ``model.tokenizer`` (else ``model.path``), and refused when its
vocabulary does not fit the model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine_core.config import ModelConfig
from engine_core.errors import ConfigError

__all__ = ["load_tokenizer"]


def load_tokenizer(model: ModelConfig, vocab_size: int | None) -> Any:
    """The actor's tokenizer: ``model.tokenizer`` (a folder), else the model folder's own.

    Refused, with what to fix, when there is none or it holds more tokens than the model's
    ``vocab_size`` (its ids would index past the embedding).
    """
    from transformers import AutoTokenizer

    where = model.tokenizer or model.path
    if not where:
        raise ConfigError(
            "a text job needs a tokenizer, and a model built from a config has none; set "
            "engine.model.tokenizer to a folder holding one (saved with save_pretrained)."
        )
    if not Path(where).is_dir():
        raise ConfigError(f"tokenizer folder {where} does not exist; set engine.model.tokenizer.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=model.trust_remote_code)
    except Exception as e:
        raise ConfigError(
            f"no tokenizer could be read from {where}: {type(e).__name__}: {e}"
        ) from e
    vocab = vocab_size
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(
            f"the tokenizer in {where} has {len(tokenizer)} tokens but the model's vocabulary "
            f"has {vocab}: its ids would index past the embedding. Use the model's own "
            f"tokenizer (engine.model.tokenizer), or a model with vocab_size >= {len(tokenizer)}."
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
