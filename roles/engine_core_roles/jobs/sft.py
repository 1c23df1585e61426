"""``engine-core train``: supervised training of a model through any registered engine, on a
user's conversations (``data``: chat rows read from files) or on the built-in digit task
(``task``).

The job is configured by a YAML recipe plus dotted overrides, resolved against the chosen
engine's config class before anything is built; the tokenizer and the datasets are read and
every row checked before the engine is. A conversation is tokenized as the RL job's warm-up and
episode rollout tokenize it (:class:`~engine_core_roles.episodes.demos.DemoRenderer`: the loss
on the assistant's tokens only; a vision-language model's conversations may hold images, each
batch carrying its rows' pixels), and the steps are
:class:`~engine_core_roles.trainer.sft.SFTTrainer`'s (the supervised step every job shares, the
validation loss every ``eval_every`` steps). Around them: checkpoints (the engine, the data
position and the step, committed together) every ``save_every`` steps and at the end, exact
``--resume``, a progress bar, ``metrics.jsonl`` (and TensorBoard, a plot), and a Hugging Face
export with the tokenizer (and a vision-language model's image processor).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, PositiveInt, ValidationError, model_validator
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from tensordict import TensorDict

from engine_core.checkpoint import ROOT_PART, JobCheckpoints
from engine_core.config import EngineConfig, ModelConfig
from engine_core.configio import prefix_validation_error
from engine_core.engine import BaseEngine
from engine_core.errors import EXIT_STOPPED, CheckpointError, RunStopped
from engine_core.models import build_hf_config
from engine_core.plugins import BackendSpec, PluginManager
from engine_core.resolve import resolve_engine_config
from engine_core_roles.data.datasets.chats import ChatData, ChatDataConfig
from engine_core_roles.data.datasets.images import ImagePromptRenderer, image_renderer
from engine_core_roles.data.datasets.tokenizer import load_tokenizer
from engine_core_roles.data.tasks.digits import DigitTask
from engine_core_roles.episodes.demos import DemoRenderer
from engine_core_roles.jobs.config import JobConfig
from engine_core_roles.jobs.saving import export_hf, save_checkpoint
from engine_core_roles.jobs.stopping import StopRequests
from engine_core_roles.jobs.tracking import (
    RunTracker,
    failures_logged,
    starting_point,
)
from engine_core_roles.trainer.sft import NoValidation, SFTTrainer, Validation, supervised_update

__all__ = ["SFTJobConfig", "run_sft", "chat_datasets", "Chats"]

# the panels of the run's plot, where logged
PLOT_KEYS = ("loss", "val/loss", "target_prob", "grad_norm", "lr", "tokens_per_s")


class SFTJobConfig(JobConfig):
    """A supervised run: conversations from files (``data``) or the built-in digit task
    (``task``), how many rows a step, validation, checkpoints, and the engine."""

    output_dir: str = "outputs/sft"
    batch_size: PositiveInt = Field(
        32, description="Rows a step (conversations, or digit-task samples): one optimizer step."
    )
    data: ChatDataConfig | None = Field(
        None,
        description="Conversations from files, tokenized with the model's tokenizer "
        "(engine.model.tokenizer or engine.model.path) through its chat template; trained on "
        "the assistant's tokens. None: the built-in digit task (`task`).",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="The loss on data.val_files (val/loss: token-mean over every assistant "
        "token, no update) every N steps and at the end (0: never).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> SFTJobConfig:
        if self.data is not None and "task" in self.model_fields_set:
            raise ValueError(
                "both task (the built-in digit task) and data (conversations from files) are "
                "set; a run trains on one: drop one of them."
            )
        if self.eval_every and (self.data is None or not self.data.val_files):
            raise ValueError(
                f"eval_every={self.eval_every} measures the loss on data.val_files, which is not "
                f"set; add data.val_files, or set eval_every=0."
            )
        return self


@dataclass
class Chats:
    """The SFT job's text pieces, read and checked before any engine is built."""

    tokenizer: Any
    train: ChatData
    val: ChatData | None = None
    images: ImagePromptRenderer | None = None  # a vision-language model's, with its processor


def chat_datasets(
    data: ChatDataConfig, model_cfg: ModelConfig, console: Console | None = None
) -> Chats:
    """The tokenizer and the datasets of ``data``: every row checked and tokenized (the
    assistant's tokens trained on; a vision-language model's rows may hold images, rendered
    through its folder's image processor), conversations longer than the model's context (or
    ``data.max_length``) dropped and counted (and said on ``console``)."""
    whole = build_hf_config(model_cfg)
    hf_config = whole.get_text_config()  # a vision-language model's decoder
    tokenizer = load_tokenizer(model_cfg, getattr(hf_config, "vocab_size", None))
    context = getattr(hf_config, "max_position_embeddings", None)
    limits = [v for v in (data.max_length, context) if v is not None]
    limit = int(min(limits)) if limits else 1 << 30
    images = image_renderer(model_cfg, whole, tokenizer, max_image_pixels=data.max_image_pixels)
    render = DemoRenderer(tokenizer, images=images)
    pad = int(tokenizer.pad_token_id or 0)

    def read(files: list[str], what: str) -> ChatData:
        chats = ChatData(files, render, data, max_length=limit, pad_token_id=pad, what=what)
        if console is not None:
            dropped = (
                f"; {chats.dropped} longer than {limit} tokens dropped" if chats.dropped else ""
            )
            console.print(f"{what}: {len(chats)} conversations{dropped}")
        return chats

    chats = Chats(tokenizer, read(data.train_files, "data.train_files"), images=images)
    if data.val_files:
        chats.val = read(data.val_files, "data.val_files")
    return chats


def run_sft(
    raw: dict[str, Any],
    manager: PluginManager,
    *,
    resume: bool | str | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the job described by ``raw``; ``resume`` as for
    :func:`~engine_core_roles.jobs.rl.run.run_rl_job`. Returns a summary (losses, files written)."""
    console = console or Console()
    try:
        job = SFTJobConfig.model_validate(raw)
    except ValidationError as e:
        raise prefix_validation_error(e, (), "SFTJobConfig") from None
    out_dir = Path(job.output_dir)
    ckpt_root = out_dir / "checkpoints"
    # refused before anything is built or overwritten: a folder holding another run, or one
    # that cannot be written, --resume without a checkpoint; then the engine's config, the
    # tokenizer and every row
    resume_from = starting_point(
        out_dir,
        [ROOT_PART],
        resume=resume,
        configured=job.resume,
        command="engine-core train",
        console=console,
    )
    spec, engine_cfg = resolve_engine_config(job.engine, manager, path=("engine",))
    chats = None if job.data is None else chat_datasets(job.data, engine_cfg.model, console)
    safe = f"checkpoints already saved under {ckpt_root} are kept, and --resume continues"
    with failures_logged(out_dir, command="engine-core train", safe=safe):
        return _train(job, spec, engine_cfg, chats, resume_from, console)


def _train(
    job: SFTJobConfig,
    spec: BackendSpec,
    engine_cfg: EngineConfig,
    chats: Chats | None,
    resume_from: str | None,
    console: Console,
) -> dict[str, Any]:
    out_dir = Path(job.output_dir)
    engine: BaseEngine = spec.load_class()(engine_cfg)
    engine.init_model()
    task = DigitTask(job.task) if chats is None else None

    def next_batch() -> TensorDict:
        if chats is not None:
            return chats.train.next_batch(job.batch_size)
        assert task is not None
        return task.supervised_batch(job.batch_size)  # type: ignore[no-any-return]

    def position() -> dict[str, Any]:
        """Where the rows continue: the dataset's position, or the digit task's sampler."""
        if chats is not None:
            return {"data": chats.train.state_dict()}
        assert task is not None
        return {"task_rng": task.rng_state()}

    checkpoints = JobCheckpoints(out_dir / "checkpoints", max_ckpt_to_keep=job.max_ckpt_to_keep)
    parts = {ROOT_PART: engine}  # the engine's files at the folder's root, as save_checkpoint's
    done, ckpt = 0, resume_from
    if resume_from is not None:
        done = _restore(
            checkpoints.load(resume_from, parts, verified=True), resume_from, chats, task
        )
        console.print(f"resumed from {resume_from} (next step {done + 1})")
    trainer = SFTTrainer(
        supervised_update(engine),
        next_batch,
        validation=_validation(job, engine, chats),
        global_step=done,
    )
    what = (
        "digit task " + job.task.name
        if chats is None
        else ", ".join(Path(f).name for f in chats.train.cfg.train_files)
    )
    console.print(
        f"[bold]engine-core train[/]: engine={spec.name} on {what}, steps={job.steps} "
        f"batch={job.batch_size} -> {out_dir}"
    )
    tracker = RunTracker.for_job(job, resume_after_step=done)
    progress = Progress(
        TextColumn("[bold blue]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:.0f} tok/s"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    stop, reason, step = StopRequests(job.stop_signals, job.max_wall_time), None, done
    try:
        with progress, stop.installed():
            bar = progress.add_task(
                "train", total=job.steps, completed=done, loss=float("nan"), tps=0.0
            )
            while trainer.global_step < job.steps:
                row = trainer.step()
                step = row["step"]
                tracker.log(row)
                progress.update(bar, advance=1, loss=row["loss"], tps=row["tokens_per_s"])
                if step % job.log_every == 0 or step == job.steps:
                    val_text = f" val {row['val/loss']:.4f}" if "val/loss" in row else ""
                    console.print(
                        f"step {step:>4}/{job.steps} loss {row['loss']:.4f}{val_text} "
                        f"p_target {row.get('target_prob', float('nan')):.3f} "
                        f"gnorm {row['grad_norm']:.3f} lr {row['lr']:.1e} "
                        f"{row['tokens_per_s']:.0f} tok/s"
                    )
                reason = stop.requested() if step < job.steps else None
                if reason or step == job.steps or (job.save_every and step % job.save_every == 0):
                    saved = save_checkpoint(
                        checkpoints,
                        step,
                        parts,
                        {"step": step, **position()},
                        last=ckpt,
                        on_failure=job.on_save_failure,
                        console=console,
                    )
                    ckpt = saved if saved is not None else ckpt
                if reason:
                    break
    except BaseException:
        tracker.close()  # whatever stopped the run: the rows written stay
        raise
    if reason:
        tracker.close("stopped")
        raise RunStopped(
            f"engine-core train stopped on {reason} after step {step} of {job.steps} "
            f"(the step in flight when it came was finished): newest checkpoint {ckpt}; rerun "
            f"the same command with --resume auto to continue (exit status {EXIT_STOPPED}).",
            ckpt,
        )
    hf_export = export_hf(
        engine.export_hf,
        out_dir / "hf_export",
        tokenizer=None if chats is None else chats.tokenizer,
        image_processor=None if chats is None or chats.images is None else chats.images.processor,
        last=ckpt,
        on_failure=job.on_save_failure,
        console=console,
    )
    rows = tracker.rows
    plot = tracker.plot(PLOT_KEYS, title=f"SFT on {what} ({job.steps} steps)")
    vals = [r["val/loss"] for r in rows if "val/loss" in r]
    summary = {
        "engine": spec.name,
        "steps": job.steps,
        "first_loss": rows[0]["loss"] if rows else None,
        "final_loss": rows[-1]["loss"] if rows else None,
        "final_target_prob": rows[-1].get("target_prob") if rows else None,
        "final_val_loss": vals[-1] if vals else None,
        "metrics": str(tracker.metrics_path),
        "plot": str(plot),
        "checkpoint": ckpt,
        "hf_export": hf_export,
    }
    tracker.close("finished", summary)
    console.print_json(data=summary)
    return summary


def _validation(job: SFTJobConfig, engine: BaseEngine, chats: Chats | None) -> NoValidation:
    """The loss on data.val_files every ``eval_every`` steps and at the last, where set."""
    val = None if chats is None else chats.val
    if val is None or not job.eval_every:
        return NoValidation()
    return Validation(
        engine,
        lambda: val.batches(job.batch_size),
        every=job.eval_every,
        last_step=job.steps,
    )


def _restore(
    state: dict[str, Any], folder: str, chats: Chats | None, task: DigitTask | None
) -> int:
    """Put the job's position back from a checkpoint's job state; return its step."""
    where = "data" if chats is not None else "task_rng"
    if not isinstance(state.get("step"), int) or where not in state:
        raise CheckpointError(
            f"{folder} holds no SFT job position (step, {where}); it was not saved by "
            f"engine-core train with this job's {'data' if chats is not None else 'task'}. "
            f"Resume from another checkpoint, or with the settings that saved it."
        )
    if chats is not None:
        chats.train.load_state_dict(state["data"])
    else:
        assert task is not None
        task.set_rng_state(state["task_rng"])
    return int(state["step"])
