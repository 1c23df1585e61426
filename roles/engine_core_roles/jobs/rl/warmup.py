"""The supervised warm-up before RL: demonstrations on the text job, the digit task's answers on
the built-in one; :class:`~engine_core_roles.trainer.sft.SFTTrainer`'s steps on whatever holds
the actor (its engine, or its worker group), the same step as the SFT job's, LR schedule
included: the warm-up's steps count in the actor's schedule like its RL updates. With
``warmup_lr`` they are the schedule's prelude, at that rate (``OptimConfig.prelude_steps``),
and RL's schedule starts after them at ``engine.optim.lr``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.errors import ConfigError
from engine_core_roles.data.tasks.digits import DigitTask
from engine_core_roles.episodes.demos import demo_batch
from engine_core_roles.episodes.tools import check_tool_schema
from engine_core_roles.jobs.rl.config import RLJobConfig
from engine_core_roles.jobs.rl.text import TextParts
from engine_core_roles.trainer.sft import SFTTrainer, supervised_update


def warm_up_on_demos(actor_part: Any, text: TextParts, job: RLJobConfig) -> None:
    """Supervised steps on the demonstrations of data.demos and env.demos (the assistant's
    tokens only, tokenized as the rollout samples them), ``warmup_batch_size`` of them a
    step, drawn in a seeded order. A line's ``tools`` (OpenAI function schemas, as in
    OpenAI's fine-tuning format) are the tools its episode was played with, rendered by the
    template in place of the environment's: an agent job (``agent:``, no environment) warms up
    on prompts that show the tools its agent sends."""
    import json

    episodes, bases, tools = [], [], []
    for f in job.demo_files:
        try:
            lines = Path(f).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"demos: {f} cannot be read ({e.strerror}).") from None
        for i, line in enumerate(x for x in lines if x.strip()):
            try:
                row = json.loads(line)
                episodes.append(row["messages"])
                bases.append(Path(f).parent)  # image paths are relative to their file
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    f"demos: line {i + 1} of {f} is not a JSON object with 'messages'."
                ) from None
            tools.append(_line_tools(row.get("tools"), f"demos: line {i + 1} of {f}"))
    if not episodes:
        raise ConfigError(
            f"the demos ({', '.join(job.demo_files)}) hold no demonstration; add some, or set "
            f"warmup_sft_steps=0."
        )
    gen = torch.Generator().manual_seed(job.trainer.seed)

    def batch() -> TensorDict:
        pick = torch.randint(len(episodes), (job.warmup_batch_size,), generator=gen).tolist()
        return demo_batch(
            text.tokenizer,
            text.tools,
            [episodes[i] for i in pick],
            images=text.images,
            bases=[bases[i] for i in pick],
            episode_tools=[tools[i] for i in pick],
        )

    SFTTrainer(supervised_update(actor_part), batch).fit(job.warmup_sft_steps)


def _line_tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """A demonstration line's ``tools``: None (the environment's), or a list of OpenAI function
    schemas, each checked."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ConfigError(
            f"{where}: 'tools' must be a list of OpenAI function schemas; got "
            f"{type(value).__name__}."
        )
    for j, schema in enumerate(value):
        try:
            check_tool_schema(schema, str(j))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    return value


def warm_up_on_task(actor_part: Any, task: DigitTask, job: RLJobConfig) -> None:
    """Supervised steps on the digit task's answers, ``warmup_batch_size`` samples a step."""
    batches = functools.partial(task.supervised_batch, job.warmup_batch_size)
    SFTTrainer(supervised_update(actor_part), batches).fit(job.warmup_sft_steps)
