"""The stop token ids a text job's responses end at: the tokenizer's EOS and its chat template's
end of turn. Stop strings are a sampling setting (``trainer.stop_strings``) the rollout stops on
itself (:mod:`engine_core.stop_strings`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["stop_token_ids"]


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's EOS, and the chat template's end of turn where it has one."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        tid = tokenizer.convert_tokens_to_ids(name) if name in tokenizer.get_vocab() else None
        if tid is not None and tid not in ids:
            ids.append(tid)
    return ids
