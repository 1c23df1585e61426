"""Scoring a step's samples, and the stage that hands the step its samples with their scores.

:class:`Scorer` computes each sample's reward: a plain :class:`~engine_core_roles.data.rewards.functions.
RewardFn` over token ids now, a :class:`~engine_core_roles.data.rewards.functions.SampleReward` on a thread
of its own (the step computes log-probs meanwhile), a reward model's scores, or the first plus
``reward_model_weight`` times the last. :class:`ScoreAsDrawn` is the step's scoring stage
without dynamic sampling (:mod:`engine_core_roles.trainer.dynamic_sampling` is the other one).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from tensordict import TensorDict

from engine_core import ATTENTION_MASK, INPUT_IDS, SamplingParams, make_batch
from engine_core.rollout import PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK
from engine_core_roles.batch.build import training_batch
from engine_core_roles.batch.keys import RM_SCORES
from engine_core_roles.data.rewards.functions import RewardFn, Rewards, SampleReward
from engine_core_roles.trainer.generation import Drawn
from engine_core_roles.trainer.protocols import RewardRole

__all__ = ["PendingRewards", "ScoreAsDrawn", "Scored", "Scorer", "group_spread"]

PendingRewards = Callable[[], Rewards]
"""Rewards being computed: calling it waits for them."""

Scored = tuple[Drawn, TensorDict, PendingRewards, dict[str, float]]
"""A scoring stage's result: the samples the step trains on, their training batch, their
rewards, and the stage's own figures to log."""


class Scorer:
    """Each sample's reward, with the means of its parts to log."""

    def __init__(
        self,
        reward_fn: RewardFn | SampleReward | None,
        reward_model: RewardRole | None,
        reward_model_weight: float,
    ) -> None:
        self.reward_fn, self.reward_model = reward_fn, reward_model
        self.reward_model_weight = reward_model_weight
        self._pool: ThreadPoolExecutor | None = None  # a SampleReward's thread, made on first use

    def start(self, prompts: TensorDict, gen: TensorDict, batch: TensorDict) -> PendingRewards:
        """Start scoring ``gen`` (``batch``: its training batch, the reward model's input)."""
        n = int(gen.batch_size[0])
        scored = self._own(prompts, gen, n)
        if self.reward_model is None:
            return scored
        # prompt + response, as the actor reads them; the model scores each at its last token
        rm_input = make_batch(batch[INPUT_IDS], batch[ATTENTION_MASK])
        rm = self.reward_model.compute_rm_score(rm_input)[RM_SCORES].float().cpu()
        if rm.shape != (n,):
            raise ValueError(
                f"the reward model returned scores of shape {tuple(rm.shape)} for {n} samples; "
                f"it must return one per sample ({RM_SCORES} [B])."
            )
        rewards = scored()
        parts = {**rewards.metrics, "reward/model": float(rm.mean())}
        if self.reward_fn is not None:
            parts["reward/fn"] = float(rewards.scores.mean())
        combined = Rewards(
            rewards.scores + self.reward_model_weight * rm, parts, rewards.failures, rewards.samples
        )
        return lambda: combined

    def _own(self, prompts: TensorDict, gen: TensorDict, n: int) -> PendingRewards:
        """``reward_fn``'s rewards (zeros without one): a SampleReward's on the thread."""
        fn = self.reward_fn
        if isinstance(fn, SampleReward):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine-core-reward")
            return self._pool.submit(lambda: _checked(fn(prompts, gen), n)).result
        scores = torch.zeros(n)
        if fn is not None:
            scores = fn(gen[PROMPT_IDS], gen[RESPONSE_IDS], gen[RESPONSE_MASK])
            scores = torch.as_tensor(scores, dtype=torch.float32)
            if scores.shape != (n,):
                raise ValueError(
                    f"reward_fn must return one score per sample, shape ({n},); got "
                    f"{tuple(scores.shape)}. Score each row of response_ids."
                )
        rewards = Rewards(scores)
        return lambda: rewards

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class ScoreAsDrawn:
    """The scoring stage without dynamic sampling: the step trains on what it drew, scored
    while the log-probs are computed."""

    def __init__(self, scorer: Scorer, params: Callable[[int, int], SamplingParams]) -> None:
        self.scorer, self.params = scorer, params

    def __call__(self, step: int, drawn: Drawn) -> Scored:
        batch = training_batch(drawn.samples, self.params(step, 0))
        return drawn, batch, self.scorer.start(drawn.prompts, drawn.samples, batch), {}


def _checked(rewards: Rewards, n: int) -> Rewards:
    scores = torch.as_tensor(rewards.scores, dtype=torch.float32)
    if scores.shape != (n,):
        raise ValueError(
            f"a SampleReward returned scores of shape {tuple(scores.shape)} for {n} samples; "
            f"it must return one per sample."
        )
    rewards.scores = scores
    return rewards


def group_spread(scores: torch.Tensor, n: int) -> dict[str, float]:
    """The share of prompts whose samples all scored the same (no GRPO gradient from them)."""
    if n < 2 or scores.numel() % n:
        return {}
    groups = scores.view(-1, n)
    same = (groups.max(-1).values - groups.min(-1).values) == 0
    return {"reward/zero_variance_groups": float(same.float().mean())}
