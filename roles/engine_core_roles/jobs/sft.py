"""``engine-core train``: supervised training of a model through any registered engine.

The job is configured by a YAML recipe plus dotted overrides, resolved against the chosen
engine's config class and capabilities before anything is built. It prints a progress bar and a
log line every ``log_every`` steps, writes ``metrics.jsonl`` and saves a final checkpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pydantic import Field, PositiveInt, ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from engine_core.config import FrozenModel
from engine_core.configio import prefix_validation_error
from engine_core.engine import BaseEngine
from engine_core.plugins import PluginManager
from engine_core.resolve import resolve_engine_config
from engine_core_roles.algorithms.supervised import sft_loss
from engine_core_roles.data.tasks import DigitTask, TaskConfig
from engine_core_roles.jobs.tracking import claim_output_dir, failures_logged

__all__ = ["SFTJobConfig", "run_sft"]


class SFTJobConfig(FrozenModel):
    """A supervised run: which task, how many steps, where outputs go, and the engine."""

    steps: PositiveInt = 100
    batch_size: PositiveInt = 32
    log_every: PositiveInt = 10
    output_dir: str = "outputs/sft"
    task: TaskConfig = TaskConfig()
    save_checkpoint: bool = True
    max_ckpt_to_keep: PositiveInt | None = 2
    engine: dict[str, Any] = Field(..., description="Engine config; validated by the backend.")


def run_sft(
    raw: dict[str, Any], manager: PluginManager, *, console: Console | None = None
) -> dict[str, Any]:
    """Run the job described by ``raw``; return a summary (final loss, files written)."""
    console = console or Console()
    try:
        job = SFTJobConfig.model_validate(raw)
    except ValidationError as e:
        raise prefix_validation_error(e, (), "SFTJobConfig") from None
    out_dir = claim_output_dir(job.output_dir, command="engine-core train")
    safe = f"the metrics of the steps before it are in {out_dir / 'metrics.jsonl'}"
    with failures_logged(out_dir, command="engine-core train", safe=safe):
        return _train(job, manager, out_dir, console)


def _train(
    job: SFTJobConfig, manager: PluginManager, out_dir: Path, console: Console
) -> dict[str, Any]:
    spec, engine_cfg = resolve_engine_config(job.engine, manager, path=("engine",))
    engine: BaseEngine = spec.load_class()(engine_cfg)
    engine.init_model()
    engine.set_loss_fn(sft_loss)
    task = DigitTask(job.task)
    metrics_path = out_dir / "metrics.jsonl"
    console.print(
        f"[bold]engine-core train[/]: engine={spec.name} task={job.task.name} "
        f"steps={job.steps} batch={job.batch_size} -> {out_dir}"
    )
    history: list[dict[str, float]] = []
    progress = Progress(
        TextColumn("[bold blue]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:.0f} tok/s"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    with metrics_path.open("w") as log, progress:
        bar = progress.add_task("train", total=job.steps, loss=float("nan"), tps=0.0)
        for step in range(1, job.steps + 1):
            batch = task.supervised_batch(job.batch_size)
            t0 = time.perf_counter()
            with engine.train_mode():
                result = engine.forward_backward_step(batch)
                grad_norm = engine.optimizer_step()
                lr = engine.lr_scheduler_step()
                engine.optimizer_zero_grad()
            dt = time.perf_counter() - t0
            tokens = int(batch["attention_mask"].sum())
            row = {
                "step": step,
                "loss": float(result.loss or 0.0),
                "grad_norm": grad_norm,
                "lr": lr,
                "tokens_per_s": tokens / dt,
                **result.metrics,
            }
            history.append(row)
            log.write(json.dumps(row) + "\n")
            progress.update(bar, advance=1, loss=row["loss"], tps=row["tokens_per_s"])
            if step % job.log_every == 0 or step == job.steps:
                console.print(
                    f"step {step:>4}/{job.steps} loss {row['loss']:.4f} "
                    f"p_target {row.get('target_prob', float('nan')):.3f} "
                    f"gnorm {grad_norm:.3f} lr {lr:.1e} {row['tokens_per_s']:.0f} tok/s"
                )
    ckpt = None
    if job.save_checkpoint:
        ckpt = engine.save_checkpoint(
            str(out_dir / "checkpoints"), step=job.steps, max_ckpt_to_keep=job.max_ckpt_to_keep
        )
    summary = {
        "engine": spec.name,
        "steps": job.steps,
        "first_loss": history[0]["loss"],
        "final_loss": history[-1]["loss"],
        "final_target_prob": history[-1].get("target_prob"),
        "metrics": str(metrics_path),
        "checkpoint": ckpt,
    }
    console.print_json(json.dumps(summary))
    return summary
