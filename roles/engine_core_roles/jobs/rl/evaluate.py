"""Evaluation on the validation prompts: greedy or sampled, with seeds of its own."""

from __future__ import annotations

import torch

from engine_core import (
    SamplingParams,
)
from engine_core_roles.data.rewards.functions import RewardConfig
from engine_core_roles.jobs.rl.config import RLJobConfig
from engine_core_roles.jobs.rl.text import TextParts
from engine_core_roles.trainer.config import SEED_STRIDE
from engine_core_roles.trainer.loop import RLTrainer

__all__ = ["EVAL_SEED_OFFSET"]

EVAL_SEED_OFFSET = 7919  # sampled evaluation: seeds of its own, apart from the training steps


def evaluate(trainer: RLTrainer, text: TextParts, job: RLJobConfig, step: int) -> dict[str, float]:
    """Mean reward and pass@k on the validation prompts, with the rollout's current weights
    (the latest update's). A sample counts as solved at reward >= reward.success_threshold;
    pass@k is the share of prompts with a solved sample among k, pass@1 the share of samples
    solved."""
    assert text.val is not None and text.val_reward is not None
    cfg, k = job.eval, job.eval.samples_per_prompt
    base = trainer.config
    seed = base.seed * SEED_STRIDE + EVAL_SEED_OFFSET + step
    params = SamplingParams(
        temperature=0.0 if cfg.greedy else base.temperature,
        max_new_tokens=base.max_new_tokens,
        n=k,
        stop_token_ids=list(base.stop_token_ids),
        stop_strings=list(base.stop_strings),
        seed=None if cfg.greedy else seed,
    )
    threshold = (job.reward or RewardConfig()).success_threshold
    scores, failed, seen = [], 0, 0
    for batch in text.val.batches(cfg.batch_prompts):
        if cfg.max_prompts is not None and seen >= cfg.max_prompts:
            break
        if cfg.max_prompts is not None and seen + batch.batch_size[0] > cfg.max_prompts:
            batch = batch[: cfg.max_prompts - seen]
        seen += int(batch.batch_size[0])
        rewards = text.val_reward(batch, trainer.generate(batch, params))
        failed += len(rewards.failures)
        scores.append(torch.nan_to_num(rewards.scores, nan=0.0).view(-1, k))
    table = torch.cat(scores)
    solved = table >= threshold
    out = {
        "val/reward": float(table.mean()),
        "val/pass@1": float(solved.float().mean()),
    }
    if k > 1:
        out[f"val/pass@{k}"] = float(solved.any(-1).float().mean())
    if failed:
        out["val/failed_samples"] = float(failed)
    return out
