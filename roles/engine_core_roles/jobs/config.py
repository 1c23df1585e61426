"""``JobConfig``: what every job of the ``engine-core`` script sets, declared once — how long it
runs, how often it logs and saves, where its outputs go, the engine it trains, and the built-in
digit task it trains on when it reads no files. ``RLJobConfig`` and ``SFTJobConfig`` add their
own sections to it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, PositiveInt, field_validator, model_validator

from engine_core.config import FrozenModel
from engine_core_roles.data.tasks.digits import TaskConfig
from engine_core_roles.jobs.stopping import check_stop_signals
from engine_core_roles.jobs.trackers import MlflowConfig, TrackerName, WandbConfig, check_trackers

__all__ = ["JobConfig", "SEEDED_SECTIONS", "seeded"]


# the sections whose own ``seed`` the job's seed is the default of, where a job has them
SEEDED_SECTIONS = ("engine", "critic_engine", "rollout", "trainer", "data", "task")


class JobConfig(FrozenModel):
    """The settings every job shares; a job's config subclasses it (and may give
    ``output_dir`` its own default)."""

    seed: int = Field(
        0,
        description="The run's seed, and the default of each section's own: engine.seed (the "
        "model's initialisation), rollout.seed, trainer.seed (each step's sampling), data.seed "
        "and task.seed (the order rows are drawn in). A section's seed set in the recipe or on "
        "the command line wins for that section alone.",
    )

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
    on_save_failure: Literal["stop", "continue"] = Field(
        "stop",
        description="A checkpoint or the Hugging Face export that cannot be written (a full "
        "disk, whichever writer says so, any OSError): stop the run with one sentence (what "
        "failed, the space the save needs, the last safe step), or continue: training goes on "
        "and the next save tries again; a failed export ends the run without it. Either way the "
        "failed save's staging folder is removed and every committed step is kept.",
    )
    stop_signals: list[str] = Field(
        default_factory=lambda: ["SIGTERM", "SIGINT"],
        description="Signals that ask the run to stop: it finishes the step in flight, writes a "
        "checkpoint and exits with status 3 (rerun with --resume auto); sent to the job's "
        "process or to its whole process group (its workers and Ray cluster run in sessions "
        "of their own). SIGINT is a terminal's Ctrl-C. Add an earlier warning a scheduler "
        "sends, e.g. [SIGTERM, SIGINT, SIGUSR1].",
    )
    max_wall_time: float | None = Field(
        None,
        gt=0,
        description="Seconds after which the run stops as on a stop signal (checkpoint, exit "
        "status 3); None: no limit.",
    )
    resume: Literal["never", "latest", "auto"] = Field(
        "never",
        description="never: a fresh run (a folder that holds a run is refused); latest: continue "
        "from the newest checkpoint that verifies (none is an error; --resume); auto: continue "
        "from it when there is one, else start fresh in the same folder (--resume auto: the "
        "setting for a restart loop on a preemptible cluster). The command line's --resume wins.",
    )
    max_ckpt_to_keep: PositiveInt | None = Field(
        2, description="Checkpoints kept, the newest (None: all)."
    )
    trackers: list[TrackerName] = Field(
        default_factory=lambda: list[TrackerName](["tensorboard"]),
        description="Where the metrics go besides metrics.jsonl (always written): any of "
        "tensorboard, wandb, mlflow. Each gets the run's config, every step's numbers, the "
        "decoded samples and the summary; --resume continues the same tracker runs.",
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig, description="The W&B run, when trackers has wandb."
    )
    mlflow: MlflowConfig = Field(
        default_factory=MlflowConfig, description="The MLflow run, when trackers has mlflow."
    )
    engine: dict[str, Any] = Field(
        ...,
        description="The engine config of the model trained (an RL job's actor); validated by "
        "the config class of the backend it names.",
    )

    @field_validator("stop_signals")
    @classmethod
    def _catchable(cls, names: list[str]) -> list[str]:
        return check_stop_signals(names)

    @field_validator("trackers")
    @classmethod
    def _installed(cls, names: list[TrackerName]) -> list[TrackerName]:
        return check_trackers(names)

    @model_validator(mode="before")
    @classmethod
    def _seed_sections(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("seed", 0), int):
            return data  # field validation names what is wrong
        return seeded(data, cls)


def seeded(raw: dict[str, Any], job: type[JobConfig]) -> dict[str, Any]:
    """``raw`` (a ``job`` config as a mapping) with the job's ``seed`` given to each section of
    :data:`SEEDED_SECTIONS` that ``job`` declares and that sets none: one given as a mapping, or
    left to its default (a section that defaults to none stays none; the digit task only when
    no data is set). ``raw`` is not changed."""
    seed = raw.get("seed", 0)
    out = dict(raw)
    for name in SEEDED_SECTIONS:
        field = job.model_fields.get(name)
        if field is None or (name == "task" and raw.get("data") is not None):
            continue
        section = raw[name] if name in raw else field.get_default(call_default_factory=True)
        if isinstance(section, BaseModel) and name not in raw:
            out[name] = {"seed": seed}  # the section's defaults, but the job's seed
        elif isinstance(section, dict) and "seed" not in section:
            out[name] = {**section, "seed": seed}
    return out
