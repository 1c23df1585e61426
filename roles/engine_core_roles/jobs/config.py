"""``JobConfig``: what every job of the ``engine-core`` script sets, declared once — how long it
runs, how often it logs and saves, where its outputs go, the engine it trains, and the built-in
digit task it trains on when it reads no files. ``RLJobConfig`` and ``SFTJobConfig`` add their
own sections to it.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, PositiveInt

from engine_core.config import FrozenModel
from engine_core_roles.data.tasks import TaskConfig

__all__ = ["JobConfig"]


class JobConfig(FrozenModel):
    """The settings every job shares; a job's config subclasses it (and may give
    ``output_dir`` its own default)."""

    steps: PositiveInt = Field(
        100, description="Steps of the run: an RL job's RL steps, an SFT job's optimizer steps."
    )
    log_every: PositiveInt = Field(
        10, description="A console line every N steps (metrics.jsonl holds every step)."
    )
    output_dir: str = "outputs/run"  # each job names its own default
    task: TaskConfig = Field(
        default_factory=TaskConfig,
        description="The built-in digit task (token ids, no tokenizer), trained on when no data "
        "is set.",
    )
    save_every: int = Field(50, ge=0, description="Checkpoint every N steps (0: only at the end).")
    max_ckpt_to_keep: PositiveInt | None = Field(
        2, description="Checkpoints kept, the newest (None: all)."
    )
    engine: dict[str, Any] = Field(
        ...,
        description="The engine config of the model trained (an RL job's actor); validated by "
        "the config class of the backend it names.",
    )
