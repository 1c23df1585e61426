""":class:`TextReward`: each sample decoded and scored by the reward function
(:mod:`engine_core_roles.data.rewards.functions`), with its dataset row's other columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.errors import ConfigError
from engine_core.rollout import PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK
from engine_core_roles.batch.keys import EPISODE, ROW_INDEX
from engine_core_roles.data.datasets.prompts import PromptData
from engine_core_roles.data.rewards.functions import (
    RewardConfig,
    Rewards,
    SampleReward,
    Scored,
    accepts,
    load_function,
    score_samples,
)

__all__ = ["TextReward"]


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's ids where ``mask`` is 1: one boolean gather and one conversion to a list for
    the whole batch, then a slice per row."""
    keep = mask.bool()
    flat = ids[keep].tolist()
    out, start = [], 0
    for n in keep.sum(dim=1).tolist():
        out.append(flat[start : start + n])
        start += n
    return out


class _Decoder:
    """``tokenizer.decode`` of many sequences, each distinct one decoded once.

    A fast tokenizer that cleans up no spaces (the transformers default for BPE tokenizers,
    Qwen's among them) decodes straight through its Rust backend's ``decode_batch``: the same
    text as ``tokenizer.decode`` without transformers' per-token checks and per-sequence
    calls. Any other tokenizer goes through ``tokenizer.batch_decode``."""

    def __init__(self, tokenizer: Any) -> None:
        from transformers import PreTrainedTokenizerFast

        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        cleans = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.backend = backend if backend is not None and plain and not cleans else None

    def __call__(self, sequences: list[list[int]], *, skip_special_tokens: bool) -> list[str]:
        index: dict[tuple[int, ...], int] = {}
        distinct: list[list[int]] = []
        where = []
        for ids in sequences:
            key = tuple(ids)
            if key not in index:
                index[key] = len(distinct)
                distinct.append(ids)
            where.append(index[key])
        if self.backend is not None:
            texts = self.backend.decode_batch(distinct, skip_special_tokens=skip_special_tokens)
        else:
            texts = self.tokenizer.batch_decode(distinct, skip_special_tokens=skip_special_tokens)
        return [texts[i] for i in where]


class TextReward(SampleReward):
    """Scores a step's samples with a reward function over decoded text (see
    :mod:`engine_core_roles.data.rewards.functions`): each sample's prompt and response decoded, its row's
    other columns, ``prompt_ids`` and ``response_ids`` as keywords. The prompt batch's
    ``row_index`` names each prompt's row in ``data``; ``show`` decoded samples of each step
    are handed back for the samples log."""

    def __init__(
        self, cfg: RewardConfig | None, tokenizer: Any, data: PromptData, *, show: int = 4
    ) -> None:
        self.cfg, self.tokenizer, self.data, self.show = cfg, tokenizer, data, show
        self._decode = _Decoder(tokenizer)
        self.fn: Any = None
        self.name = "the environment"
        if cfg is None:  # an episode job scored by its environment alone
            return
        self.fn = load_function(cfg.fn)
        self.name = cfg.fn
        keywords = [*data.columns, "prompt_ids", "response_ids", *cfg.kwargs]
        missing = accepts(self.fn, keywords)
        if missing:
            raise ConfigError(
                f"reward.fn={cfg.fn!r} cannot take the keyword(s) {', '.join(missing)} it is "
                f"called with (the dataset's other columns, prompt_ids, response_ids and "
                f"reward.kwargs); add them to its signature, or a **kwargs."
            )

    def decode(
        self, samples: TensorDict
    ) -> tuple[list[str], list[str], list[list[int]], list[list[int]]]:
        """Each sample's prompt (special tokens kept) and response (special tokens skipped;
        an episode's: the model's last message, which the episode already holds as text), and
        their ids without padding."""
        p_ids = _unpadded(samples[PROMPT_IDS], samples[PROMPT_MASK])
        r_ids = _unpadded(samples[RESPONSE_IDS], samples[RESPONSE_MASK])
        prompts = self._decode(p_ids, skip_special_tokens=False)
        if EPISODE in samples.keys():
            responses = [str(e["final"]) for e in samples[EPISODE].tolist()]
        else:
            responses = self._decode(r_ids, skip_special_tokens=True)
        return prompts, responses, p_ids, r_ids

    def score(
        self, rows: Sequence[int], samples: TensorDict
    ) -> tuple[Scored, list[str], list[str]]:
        """Scores of ``samples`` whose dataset rows are ``rows`` (one per sample), and the
        decoded prompts and responses."""
        prompts, responses, p_ids, r_ids = self.decode(samples)
        episodes = samples[EPISODE].tolist() if EPISODE in samples.keys() else None
        if self.fn is None or self.cfg is None:
            scored = Scored([0.0] * len(rows))
        else:
            unique = sorted(set(rows))
            table = self.data.rows(unique)
            where = {r: i for i, r in enumerate(unique)}
            columns = {c: [table[c][where[r]] for r in rows] for c in table}
            columns["prompt_ids"], columns["response_ids"] = p_ids, r_ids  # type: ignore[assignment]
            scored = score_samples(
                self.fn,
                self.name,
                prompts,
                responses,
                columns,
                batched=self.cfg.batched,
                kwargs=self.cfg.kwargs,
            )
        if episodes is not None:  # plus what the environment gave
            env = [float(e["reward"]) for e in episodes]
            scored.scores = [a + b for a, b in zip(scored.scores, env, strict=True)]
            scored.components["env"] = sum(env) / max(len(env), 1)
        return scored, prompts, responses

    def __call__(self, prompts: TensorDict, samples: TensorDict) -> Rewards:
        n = int(samples.batch_size[0]) // int(prompts.batch_size[0])
        rows = prompts[ROW_INDEX].repeat_interleave(n).tolist()
        scored, texts, responses = self.score(rows, samples)
        scores = torch.tensor(scored.scores, dtype=torch.float32)
        episodes = samples[EPISODE].tolist() if EPISODE in samples.keys() else None
        shown = [
            {
                "row": rows[i],
                "prompt": texts[i],
                "response": responses[i],
                "reward": scored.scores[i],
                **({"episode": episodes[i]["messages"]} if episodes is not None else {}),
            }
            for i in range(min(self.show, len(rows)))
        ]
        metrics = {f"reward/{k}": v for k, v in scored.components.items()}
        return Rewards(scores, metrics, scored.failures, shown)

    def check(self) -> None:
        """Call the function on the first two rows with empty responses, before training: a
        wrong return type or count is an error now rather than at the first step."""
        rows = list(range(min(2, len(self.data))))
        batch = self.data.batch(rows)
        n = len(rows)
        sample = TensorDict(
            {
                PROMPT_IDS: batch[PROMPT_IDS],
                PROMPT_MASK: batch[PROMPT_MASK],
                RESPONSE_IDS: torch.zeros((n, 1), dtype=torch.long),
                RESPONSE_MASK: torch.zeros((n, 1), dtype=torch.long),
            },
            batch_size=[n],
        )
        scored, _, _ = self.score(rows, sample)
        if scored.failures:
            raise ConfigError(
                f"{scored.failures[0]}; checked on the first prompts with an empty response "
                f"before training (a reward function must score any response, the empty one "
                f"included)."
            )
