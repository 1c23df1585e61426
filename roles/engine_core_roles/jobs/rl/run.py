"""The RL job of ``engine-core run``: GRPO, or PPO with a critic, on text prompts from files
scored by a reward function (``data``, ``reward``), or on the built-in digit task's token ids
(``task``).

The loop itself is :class:`engine_core_roles.RLTrainer`; :func:`run_rl_job` builds its pieces
from one config (:mod:`~engine_core_roles.jobs.rl.build`, :mod:`~engine_core_roles.jobs.rl.text`)
and adds what a job needs around it: an optional supervised warm-up, exact resume, checkpoints,
a progress bar, metrics (JSONL, TensorBoard, a plot), evaluation, a summary and a Hugging Face
export.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from engine_core import PluginManager, prefix_validation_error
from engine_core.checkpoint import JobCheckpoints
from engine_core.config import ModelConfig
from engine_core.errors import EXIT_STOPPED, RunStopped
from engine_core.models import build_hf_config
from engine_core.moe import num_experts_of
from engine_core_roles.jobs.rl.build import Built, build, resolve, thread_plan
from engine_core_roles.jobs.rl.config import RLJobConfig
from engine_core_roles.jobs.rl.evaluate import evaluate
from engine_core_roles.jobs.rl.sources import Source, source_for
from engine_core_roles.jobs.rl.text import TextParts, text_parts
from engine_core_roles.jobs.saving import export_hf, save_checkpoint
from engine_core_roles.jobs.stopping import StopRequests
from engine_core_roles.jobs.tracking import (
    RunTracker,
    failures_logged,
    starting_point,
)
from engine_core_roles.trainer.loop import RLTrainer
from engine_core_roles.trainer.metrics import plot_keys

__all__ = ["run_rl_job"]


def run_rl_job(
    raw: dict[str, Any],
    manager: PluginManager,
    *,
    resume: bool | str | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the job in ``raw``; ``resume``: ``True`` (or ``"latest"``) continues from the latest
    checkpoint in its output_dir, ``"auto"`` from it when there is one (else fresh), ``None``
    does what the job's ``resume`` setting says (see :func:`starting_point`)."""
    console = console or Console()
    try:
        job = RLJobConfig.model_validate(raw)
    except ValidationError as e:
        raise prefix_validation_error(e, (), "RLJobConfig") from None
    resolved = resolve(job, manager)  # every backend and its config: refused before any folder
    out_dir = Path(job.output_dir)
    ckpt_root = out_dir / "checkpoints"
    # refused before anything is built or overwritten: a folder holding another run, or one
    # that cannot be written; --resume without a checkpoint
    resume_from = starting_point(
        out_dir,
        _parts(job),
        resume=resume,
        configured=job.resume,
        command="engine-core run",
        console=console,
    )
    text = text_parts(job, console)
    threads = thread_plan(job)
    before = torch.get_num_threads()
    safe = f"checkpoints already saved under {ckpt_root} are kept, and --resume continues"
    try:
        with (
            failures_logged(out_dir, command="engine-core run", safe=safe),
            contextlib.ExitStack() as stack,
        ):
            if threads.driver is not None and threads.driver != before:
                torch.set_num_threads(threads.driver)
            built = build(job, resolved, stack, threads, text)
            return _run(job, built, resume_from, console, text)
    finally:
        # only when changed: setting it at all, even to the same count, slows this process's
        # later CPU kernels (measured: 15% on the recipe's model)
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _run(
    job: RLJobConfig,
    built: Built,
    resume_from: str | None,
    console: Console,
    text: TextParts | None = None,
) -> dict[str, Any]:
    """Warm up or resume, train ``job.steps`` steps (logging, evaluating and saving as they go),
    then export and summarize."""
    source = source_for(job, text)
    roles = built.roles
    trainer = RLTrainer(
        source.trainer_config,
        actor=roles.actor,
        rollout=built.rollout,
        reward_fn=source.reward,
        prompts=source.prompts,
        reference=roles.reference,
        critic=roles.critic,
        reward_model=roles.reward_model,
        weights=built.weights,
        num_experts=num_experts_of(
            build_hf_config(ModelConfig.model_validate(job.engine["model"]))
        ),
    )
    checkpoints = JobCheckpoints(
        Path(job.output_dir) / "checkpoints", max_ckpt_to_keep=job.max_ckpt_to_keep
    )
    if resume_from is not None:
        job_state = checkpoints.load(resume_from, roles.parts, verified=True)  # resume_point did
        trainer.load_state_dict(source.resume(job_state, resume_from))
        if built.agents is not None:  # the endpoint reports the weights as the step they are
            built.agents.next_version = trainer.global_step
        console.print(f"resumed from {resume_from} (next step {trainer.global_step + 1})")
    elif job.warmup_sft_steps:
        source.warm_up(roles.actor_part)
    tracker = RunTracker.for_job(job, resume_after_step=trainer.global_step)
    try:
        return _train(job, trainer, tracker, checkpoints, built, source, resume_from, console, text)
    except BaseException:
        tracker.close()  # whatever stopped the run: the rows and events written stay
        raise


def _train(
    job: RLJobConfig,
    trainer: RLTrainer,
    tracker: RunTracker,
    checkpoints: JobCheckpoints,
    built: Built,
    source: Source,
    resume_from: str | None,
    console: Console,
    text: TextParts | None,
) -> dict[str, Any]:
    """The steps, each logged and saved as due; a stop on request checkpoints and raises."""
    save = _Save(job, checkpoints, built, source, resume_from, console)
    stop = StopRequests(job.stop_signals, job.max_wall_time)
    with _StepLog(job, tracker, console, text, trainer.global_step) as log, stop.installed():
        try:
            trainer.fit(job.steps, callbacks=[log, save], should_stop=stop.requested)
            reason = stop.requested() if trainer.global_step < job.steps else None
            if reason is not None:  # the step in flight is done: its checkpoint, then out
                save.now(trainer)
        finally:
            trainer.close()
    if reason is not None:
        tracker.close("stopped")
        raise RunStopped(
            f"engine-core run stopped on {reason} after step {trainer.global_step} of "
            f"{job.steps} (the step in flight when it came was finished): checkpoint "
            f"{save.last} written; rerun the same command with --resume auto to continue "
            f"(exit status {EXIT_STOPPED}).",
            save.last,
        )
    return _finish(job, built, text, tracker, save.last, console)


class _StepLog:
    """After each step: validation where due, the row to the tracker, the progress bar, and a
    console line every ``log_every`` steps (with the decoded samples to samples.jsonl)."""

    def __init__(
        self,
        job: RLJobConfig,
        tracker: RunTracker,
        console: Console,
        text: TextParts | None,
        done: int,
    ) -> None:
        self.job, self.tracker, self.console, self.text = job, tracker, console, text
        self.progress = Progress(
            TextColumn(f"[bold blue]{job.trainer.algorithm.name}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "reward {task.fields[reward]:.3f}  loss {task.fields[loss]:+.4f}  "
                "{task.fields[tps]:.0f} tok/s"
            ),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._done = done

    def __enter__(self) -> _StepLog:
        self.progress.__enter__()
        self.bar = self.progress.add_task(
            self.job.trainer.algorithm.name,
            total=self.job.steps,
            completed=self._done,
            reward=0.0,
            loss=0.0,
            tps=0.0,
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def __call__(self, trainer: RLTrainer, row: dict[str, Any]) -> None:
        job, step = self.job, row["step"]
        shown = row.pop("samples", None)
        every = job.eval.every
        if self.text is not None and every and (step % every == 0 or step == job.steps):
            row.update(evaluate(trainer, self.text, job, step))
        self.tracker.log(row)
        nan = float("nan")
        self.progress.update(
            self.bar,
            advance=1,
            reward=row["reward"],
            loss=row.get("actor/loss", nan),
            tps=row["tokens_per_s"],
        )
        if step % job.log_every == 0 or step == job.steps:
            if shown:
                self.tracker.log_samples(step, shown)
            val = "".join(f" {k} {v:.3f}" for k, v in row.items() if k.startswith("val/"))
            self.console.print(
                f"step {step:>4}/{job.steps} reward {row['reward']:.3f} "
                f"pg {row.get('actor/pg_loss', nan):+.4f} ent {row.get('actor/entropy', nan):.3f} "
                f"kl {row.get('actor/kl_loss', 0.0):.4f} "
                f"lp_diff {row.get('rollout/logprob_diff_max', nan):.0e} {row['time_s']:.2f}s" + val
            )


class _Save:
    """Every ``save_every`` steps and at the last: the actor (the critic under ppo), the
    prompts' position and the trainer's state (asynchronous: the generation in flight, so a
    resume trains on the same samples) in one folder, committed by one rename."""

    def __init__(
        self,
        job: RLJobConfig,
        checkpoints: JobCheckpoints,
        built: Built,
        source: Source,
        resumed_from: str | None,
        console: Console,
    ) -> None:
        self.console = console
        self.job, self.checkpoints, self.parts, self.source = (
            job,
            checkpoints,
            built.roles.parts,
            source,
        )
        self.last = resumed_from  # the newest checkpoint of the run
        self.saved_step: int | None = None  # the step self.last holds, when this run saved it

    def __call__(self, trainer: RLTrainer, row: dict[str, Any]) -> None:
        step, job = row["step"], self.job
        if step == job.steps or (job.save_every and step % job.save_every == 0):
            self.now(trainer)

    def now(self, trainer: RLTrainer) -> None:
        """A checkpoint of the trainer's step, unless it has one already."""
        step = trainer.global_step
        if self.saved_step == step:
            return
        state = {self.source.key: self.source.position(), "trainer": trainer.state_dict()}
        saved = save_checkpoint(
            self.checkpoints,
            step,
            self.parts,
            state,
            last=self.last,
            on_failure=self.job.on_save_failure,
            console=self.console,
        )
        if saved is not None:
            self.last, self.saved_step = saved, step


def _finish(
    job: RLJobConfig,
    built: Built,
    text: TextParts | None,
    tracker: RunTracker,
    checkpoint: str | None,
    console: Console,
) -> dict[str, Any]:
    """The Hugging Face export, the plot and the summary the console shows."""
    out_dir = Path(job.output_dir)
    hf_export = export_hf(
        built.roles.actor_part.export_hf,
        out_dir / "hf_export",
        tokenizer=None if text is None else text.tokenizer,
        image_processor=None if text is None or text.images is None else text.images.processor,
        last=checkpoint,
        on_failure=job.on_save_failure,
        console=console,
    )
    rows = tracker.rows
    what = (
        job.task.name if job.data is None else ", ".join(Path(f).name for f in job.data.train_files)
    )
    title = f"{job.trainer.algorithm.name.upper()} on '{what}' ({job.steps} steps)"
    plot = tracker.plot(plot_keys(rows), title=title)
    rewards = [r["reward"] for r in rows]
    first, last = rewards[: min(10, len(rewards))], rewards[-min(10, len(rewards)) :]
    summary = {
        "steps": job.steps,
        "reward_first10": sum(first) / len(first),
        "reward_last10": sum(last) / len(last),
        "metrics": str(tracker.metrics_path),
        "tensorboard": str(tracker.tensorboard_dir),
        "plot": str(plot),
        "checkpoint": checkpoint,
        "hf_export": hf_export,
    }
    val_keys = [k for r in rows for k in r if k.startswith("val/pass@")]
    if val_keys:
        key = max(set(val_keys), key=lambda k: (k != "val/pass@1", k))  # pass@k over pass@1
        best = max((r for r in rows if key in r), key=lambda r: r[key])
        summary.update(
            {"best_val": best[key], "best_val_metric": key, "best_val_step": best["step"]}
        )
    tracker.close("finished", summary)
    _print_summary(console, summary)
    return summary


def _parts(job: RLJobConfig) -> list[str]:
    """The engines a checkpoint of ``job`` holds: the actor, and the critic when the
    algorithm trains one."""
    return ["actor", "critic"] if job.needs_critic else ["actor"]


def _print_summary(console: Console, summary: dict[str, Any]) -> None:
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_row("reward (first 10 steps)", f"{summary['reward_first10']:.3f}")
    table.add_row("reward (last 10 steps)", f"{summary['reward_last10']:.3f}")
    if "best_val" in summary:
        table.add_row(
            f"best {summary['best_val_metric']}",
            f"{summary['best_val']:.3f} (step {summary['best_val_step']})",
        )
    for key in ("metrics", "tensorboard", "plot", "checkpoint", "hf_export"):
        table.add_row(key, str(summary[key]))
    console.print(Panel(table, title="engine-core run: done", expand=False))
