"""Stop strings: single-token ones become the rollout's stop ids; longer ones end a response after
the token that completes the first of them (:class:`StopStrings`), masking what follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict

from engine_core.rollout import RESPONSE_IDS, RESPONSE_MASK

__all__ = ["stop_token_ids", "multi_token_stop_strings", "StopStrings"]


def stop_token_ids(tokenizer: Any, strings: Sequence[str] = ()) -> list[int]:
    """The tokenizer's EOS (and the chat template's end of turn, when it has one), plus the
    token of each of ``strings`` that is one token (the rollouts stop on those themselves;
    :class:`StopStrings` ends responses at the others)."""
    extra = [ids[0] for ids in (_token_ids(tokenizer, t) for t in strings) if len(ids) == 1]
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        tid = tokenizer.convert_tokens_to_ids(name) if name in tokenizer.get_vocab() else None
        if tid is not None and tid not in ids:
            ids.append(tid)
    return ids + [t for t in extra if t not in ids]


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def multi_token_stop_strings(tokenizer: Any, strings: Sequence[str]) -> list[str]:
    """Those of ``strings`` that are more than one token of ``tokenizer``."""
    return [t for t in strings if len(_token_ids(tokenizer, t)) != 1]


class StopStrings:
    """Ends each response at the first of ``strings`` its text holds: the tokens after the one
    that completes the string get ``response_mask`` 0, as if generation had stopped there (the
    string stays in the response). For stop strings of several tokens, which the rollouts,
    stopping on token ids, cannot stop at themselves: they generate on to another stop or
    ``max_new_tokens``, and what they write past the string is dropped, never trained on or
    scored. The rollout's log-probs of the kept tokens are those it sampled them with."""

    def __init__(self, tokenizer: Any, strings: Sequence[str]) -> None:
        if not strings or any(not s for s in strings):
            raise ValueError(f"stop strings must be non-empty strings; got {list(strings)!r}.")
        self.tokenizer = tokenizer
        self.strings = list(strings)

    def _holds(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in self.strings)

    def __call__(self, samples: TensorDict) -> TensorDict:
        mask = samples[RESPONSE_MASK]
        cut = mask.clone()
        for i in range(mask.shape[0]):
            where = mask[i].nonzero().squeeze(-1)
            ids = samples[RESPONSE_IDS][i][where].tolist()
            if not self._holds(ids):
                continue
            # the shortest prefix that holds a stop string (holding one is monotone in length)
            lo, hi = 1, len(ids)
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self._holds(ids[:mid]) else (mid + 1, hi)
            cut[i, where[lo:]] = 0
        samples[RESPONSE_MASK] = cut
        return samples
