"""Stop strings (:attr:`engine_core.rollout.SamplingParams.stop_strings`): the one definition of
where they end a response, and the tokenizer a rollout decodes with to find them.

A response ends after the first token at which its text (the response's ids so far, decoded by
the model's tokenizer with special tokens skipped) holds one of the strings. The string stays in
the response, possibly with the rest of the token that completed it, and the sample is not
truncated. A rollout that stops on strings declares ``Capability.STOP_STRINGS``; the rollout kit
compares where each sample ends with :func:`stop_string_end` on the oracle's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine_core.config import ModelConfig
from engine_core.errors import CapabilityError

__all__ = ["stop_string_end", "holds_stop_string", "tokenizer_folder", "load_stop_tokenizer"]

# what save_pretrained writes for a tokenizer (one of them is enough to load one)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def holds_stop_string(text: str, strings: Sequence[str]) -> bool:
    return any(s in text for s in strings)


def stop_string_end(
    decode: Callable[[list[int]], str], ids: Sequence[int], strings: Sequence[str]
) -> int | None:
    """How many of ``ids`` a response keeps when ``strings`` end it: one past the first token
    at which ``decode(ids[:k])`` holds a string; None where no prefix holds one. Linear in the
    prefixes (decoding a longer prefix can change the text of a shorter one, so no bisection)."""
    ids = list(ids)
    for k in range(1, len(ids) + 1):
        if holds_stop_string(decode(ids[:k]), strings):
            return k
    return None


def tokenizer_folder(model: ModelConfig) -> str | None:
    """The folder the model's tokenizer is read from (``model.tokenizer``, else the model
    folder), where it holds one; None otherwise (a model built from a config has none)."""
    where = model.tokenizer or model.path
    if where is None or not Path(where).is_dir():
        return None
    return where if any((Path(where) / f).is_file() for f in _TOKENIZER_FILES) else None


def load_stop_tokenizer(model: ModelConfig, who: str) -> Any:
    """The tokenizer ``who`` (a rollout) decodes its responses with to find stop strings;
    refused, with what to set, where the model has none."""
    where = tokenizer_folder(model)
    if where is None:
        raise CapabilityError(
            f"{who}: stop_strings are found in the decoded text, and this model has no "
            f"tokenizer (model.tokenizer={model.tokenizer!r}, model.path={model.path!r}); set "
            f"model.tokenizer to a folder holding one (save_pretrained), or stop on token ids "
            f"(stop_token_ids)."
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(where, trust_remote_code=model.trust_remote_code)
