"""The supervised warm-up before RL: demonstrations on the text job, the digit task's answers on
the built-in one; one supervised step on whatever holds the actor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from engine_core import (
    BaseEngine,
)
from engine_core.errors import ConfigError
from engine_core_roles.algorithms.supervised import supervised_step
from engine_core_roles.data.tasks import DigitTask
from engine_core_roles.episodes.demos import demo_batch
from engine_core_roles.jobs.rl.config import RLJobConfig
from engine_core_roles.jobs.rl.text import TextParts


def supervised_step_of(actor_part: Any) -> Callable[[TensorDict], dict[str, float]]:
    """One supervised step of the actor, wherever it is: its engine in this process, or its
    worker group (each DP rank on its share of the batch). The same step as the SFT job's,
    LR schedule included (see :func:`~engine_core_roles.algorithms.supervised.supervised_step`):
    the warm-up's steps count in the actor's schedule like its RL updates."""

    if isinstance(actor_part, BaseEngine):
        return functools.partial(supervised_step, actor_part)
    step: Callable[[TensorDict], dict[str, float]] = actor_part.supervised_step
    return step


def warm_up_on_demos(actor_part: Any, text: TextParts, job: RLJobConfig) -> None:
    """Supervised steps on the demonstrations of data.demos and env.demos (the assistant's
    tokens only, tokenized as the rollout samples them), ``warmup_batch_size`` of them a
    step, drawn in a seeded order."""
    import json

    episodes = []
    for f in job.demo_files:
        try:
            lines = Path(f).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"demos: {f} cannot be read ({e.strerror}).") from None
        for i, line in enumerate(x for x in lines if x.strip()):
            try:
                episodes.append(json.loads(line)["messages"])
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    f"demos: line {i + 1} of {f} is not a JSON object with 'messages'."
                ) from None
    if not episodes:
        raise ConfigError(
            f"the demos ({', '.join(job.demo_files)}) hold no demonstration; add some, or set "
            f"warmup_sft_steps=0."
        )
    gen = torch.Generator().manual_seed(job.trainer.seed or 0)
    step = supervised_step_of(actor_part)
    for _ in range(job.warmup_sft_steps):
        pick = torch.randint(len(episodes), (job.warmup_batch_size,), generator=gen).tolist()
        step(demo_batch(text.tokenizer, text.tools, [episodes[i] for i in pick]))


def warm_up_on_task(actor_part: Any, task: DigitTask, job: RLJobConfig) -> None:
    step = supervised_step_of(actor_part)
    for _ in range(job.warmup_sft_steps):
        step(task.supervised_batch(job.warmup_batch_size))
