"""Where a job's prompts and rewards come from, and where they continue after a resume: the
built-in digit task (token ids, scored by the task), or the text job's prompt files and reward
function. Each also knows its supervised warm-up.
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict

from engine_core import BaseEngine
from engine_core.errors import CheckpointError
from engine_core_roles.data.rewards.functions import RewardFn, SampleReward
from engine_core_roles.data.tasks.digits import PAD, DigitTask
from engine_core_roles.distributed.placement import RoleGroup
from engine_core_roles.jobs.rl.config import RLJobConfig
from engine_core_roles.jobs.rl.text import TextParts
from engine_core_roles.jobs.rl.warmup import warm_up_on_demos, warm_up_on_task
from engine_core_roles.serving.agent_function import AgentReward
from engine_core_roles.trainer.config import TrainerConfig
from engine_core_roles.trainer.protocols import PromptBatch

__all__ = ["Source", "TaskSource", "TextSource", "source_for"]


class Source:
    """A job's prompts (``prompts(step)``), their reward, the trainer's config for them, and
    the position a checkpoint keeps (under ``key``)."""

    key = ""
    trainer_config: TrainerConfig
    reward: RewardFn | SampleReward

    def prompts(self, step: int) -> PromptBatch:
        raise NotImplementedError

    def position(self) -> Any:
        raise NotImplementedError

    def restore(self, position: Any) -> None:
        raise NotImplementedError

    def warm_up(self, actor: BaseEngine | RoleGroup) -> None:
        raise NotImplementedError

    def resume(self, state: dict[str, Any], where: str) -> dict[str, Any]:
        """The trainer's state in a job checkpoint's ``state``, after restoring this source's
        position from it; refused when the checkpoint was saved by another kind of job."""
        if not isinstance(state.get("trainer"), dict) or self.key not in state:
            what = "task" if isinstance(self, TaskSource) else "data"
            raise CheckpointError(
                f"{where} holds no job position (trainer, {self.key}); it was not saved by "
                f"engine-core run with this job's {what}. Resume from another checkpoint, or "
                f"with the settings that saved it."
            )
        self.restore(state[self.key])
        trainer: dict[str, Any] = state["trainer"]
        return trainer


class TaskSource(Source):
    """The built-in digit task: prompts of ``prompts_per_step`` digit strings, scored by the
    task on the response's token ids."""

    key = "task_rng"

    def __init__(self, job: RLJobConfig) -> None:
        self.job, self.task = job, DigitTask(job.task)
        self.trainer_config = job.trainer_config(self.task)
        task = self.task
        self.reward = lambda prompt, response, mask: task.score(
            prompt, response.masked_fill(mask == 0, PAD)
        )

    def prompts(self, step: int) -> PromptBatch:
        return self.task.prompt_ids(self.task.sample_digits(self.job.prompts_per_step))

    def position(self) -> Any:
        return self.task.rng_state()

    def restore(self, position: Any) -> None:
        self.task.set_rng_state(position)

    def warm_up(self, actor: BaseEngine | RoleGroup) -> None:
        warm_up_on_task(actor, self.task, self.job)


class TextSource(Source):
    """The text job: batches of the training prompt files, scored by the reward function on the
    decoded samples."""

    key = "data"

    def __init__(self, job: RLJobConfig, text: TextParts) -> None:
        self.job, self.text = job, text
        self.trainer_config = job.text_trainer_config(text.stops)
        # agents: each session's own reward, the reward function's where the agent gave none
        self.reward = text.reward if text.agent is None else AgentReward(text.reward)

    def prompts(self, step: int) -> TensorDict:
        return self.text.train.next_batch(self.job.prompts_per_step)

    def position(self) -> Any:
        return self.text.train.state_dict()

    def restore(self, position: Any) -> None:
        self.text.train.load_state_dict(position)

    def warm_up(self, actor: BaseEngine | RoleGroup) -> None:
        warm_up_on_demos(actor, self.text, self.job)


def source_for(job: RLJobConfig, text: TextParts | None) -> Source:
    return TaskSource(job) if text is None else TextSource(job, text)
