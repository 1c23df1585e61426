"""The RL training loop of ``engine-core run``: GRPO, or PPO with a critic, on the shipped tasks.

Each step: generate ``samples_per_prompt`` responses per prompt → score them with the task's
rule-based reward → (reference log-probs) → advantages (``grpo``: group-normalized scores;
``ppo``: GAE over the critic's values, then a critic update) → actor update → weight sync to
the rollout (verified) → log. An optional supervised warm-up runs first. The rollout runs in this
process or, with ``rollout_placement: process``, in a process of its own that receives weights
over a gloo group (:mod:`engine_core.remote_rollout`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, PositiveInt, ValidationError, model_validator
from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from tensordict import TensorDict

from engine_core import (
    BaseEngine,
    FrozenModel,
    PluginManager,
    SamplingParams,
    make_batch,
    prefix_validation_error,
    resolve_engine_config,
    resolve_rollout_config,
)
from engine_core.checkpoint import latest_checkpoint, load_torch, save_torch, step_dir
from engine_core.errors import CheckpointError
from engine_core.rollout import BaseRollout
from engine_core.tasks import EOS, DigitTask, TaskConfig
from engine_core.tracking import RunTracker
from roles.actor import ADVANTAGES, OLD_LOG_PROBS, REF_LOG_PROBS, Actor, ActorConfig
from roles.advantages import gae_advantages, grpo_advantages, sequence_to_token_rewards
from roles.critic import OLD_VALUES, RETURNS, Critic, CriticConfig
from roles.reference import Reference

__all__ = ["GRPOJobConfig", "run_grpo"]


class GRPOJobConfig(FrozenModel):
    """An RL run: algorithm, task, sampling, the actor's (and critic's) engine, the rollout."""

    algorithm: Literal["grpo", "ppo"] = Field(
        "grpo",
        description="grpo: group-normalized scores as advantages, no critic; ppo: GAE over a "
        "critic's values (whitened), and a critic update every step.",
    )
    steps: PositiveInt = 100
    prompts_per_step: PositiveInt = 16
    samples_per_prompt: PositiveInt = 8
    temperature: float = Field(1.0, gt=0)
    warmup_sft_steps: int = Field(0, ge=0, description="Supervised steps before RL (0: none).")
    warmup_batch_size: PositiveInt = 32
    log_every: PositiveInt = 10
    output_dir: str = "outputs/grpo"
    task: TaskConfig = TaskConfig()
    actor: ActorConfig = ActorConfig()
    save_every: int = Field(50, ge=0, description="Checkpoint every N steps (0: only at the end).")
    max_ckpt_to_keep: PositiveInt | None = 2
    engine: dict[str, Any] = Field(..., description="The actor's engine config.")
    rollout: dict[str, Any] = Field(default_factory=lambda: {"backend": "hf"})
    rollout_placement: Literal["colocated", "process"] = Field(
        "colocated",
        description="colocated: the rollout runs in this process; process: in a process of its "
        "own, weights streamed to it over a gloo (NCCL on GPUs) group and verified.",
    )
    critic: CriticConfig = CriticConfig()
    critic_engine: dict[str, Any] | None = Field(
        None,
        description="ppo: the critic's engine config; default: the actor's engine config with "
        "model.value_head=true.",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="ppo: GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="ppo: GAE lambda.")

    @model_validator(mode="after")
    def _check_algorithm(self) -> GRPOJobConfig:
        if self.algorithm == "grpo" and self.samples_per_prompt < 2:
            raise ValueError(
                f"grpo normalizes rewards within each prompt's group, so samples_per_prompt "
                f"must be >= 2 (got {self.samples_per_prompt}); raise it, or use algorithm=ppo."
            )
        if self.algorithm == "grpo" and self.critic_engine is not None:
            raise ValueError(
                "critic_engine is set but algorithm=grpo trains no critic; remove critic_engine "
                "or set algorithm=ppo."
            )
        return self

    def critic_engine_config(self) -> dict[str, Any]:
        if self.critic_engine is not None:
            return self.critic_engine
        return {**self.engine, "model": {**self.engine["model"], "value_head": True}}


def _build(
    job: GRPOJobConfig, manager: PluginManager
) -> tuple[BaseEngine, BaseRollout, BaseEngine | None, BaseEngine | None]:
    # every config is resolved (and refused, naming the field) before anything is built
    spec, engine_cfg = resolve_engine_config(job.engine, manager, path=("engine",))
    rollout_raw = {"model": job.engine["model"], **job.rollout}
    rspec, rollout_cfg = resolve_rollout_config(rollout_raw, manager, path=("rollout",))
    critic_spec = critic_cfg = None
    if job.algorithm == "ppo":
        path = ("critic_engine",)
        critic_spec, critic_cfg = resolve_engine_config(
            job.critic_engine_config(), manager, path=path
        )
    engine: BaseEngine = spec.load_class()(engine_cfg)
    engine.init_model()
    if job.rollout_placement == "process":
        from engine_core.remote_rollout import ProcessRollout

        rollout: BaseRollout = ProcessRollout(rollout_cfg)  # type: ignore[arg-type]
    else:
        rollout = rspec.load_class()(rollout_cfg)
    ref_engine = None
    if job.actor.use_kl_loss:
        ref_engine = spec.load_class()(engine_cfg)
        ref_engine.init_model()  # same seed: the initial policy
    critic_engine = None
    if critic_spec is not None:
        critic_engine = critic_spec.load_class()(critic_cfg)
        critic_engine.init_model()
    return engine, rollout, ref_engine, critic_engine


def _training_batch(out: TensorDict) -> TensorDict:
    prompt, pmask = out["prompt_ids"], out["prompt_mask"]
    resp, rmask = out["response_ids"], out["response_mask"]
    return make_batch(
        torch.cat([prompt, resp], 1),
        torch.cat([pmask, rmask], 1),
        loss_mask=torch.cat([torch.zeros_like(pmask), rmask], 1),
    )


PLOT_KEYS = (
    "reward",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/approx_kl",
    "actor/entropy",
    "actor/clipfrac",
    "rollout/logprob_diff_max",
    "critic/vf_loss",
)
TRAINER_STATE = "trainer_state.pt"


def run_grpo(
    raw: dict[str, Any],
    manager: PluginManager,
    *,
    resume: bool = False,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the job in ``raw``; with ``resume``, continue from the latest checkpoint in its output_dir."""
    console = console or Console()
    try:
        job = GRPOJobConfig.model_validate(raw)
    except ValidationError as e:
        raise prefix_validation_error(e, (), "GRPOJobConfig") from None
    out_dir = Path(job.output_dir)
    ckpt_root = out_dir / "checkpoints"
    latest = latest_checkpoint(ckpt_root)
    if resume and latest is None:
        raise CheckpointError(
            f"--resume: no checkpoint under {ckpt_root}; run without --resume to start fresh."
        )
    if not resume and latest is not None:  # refused before anything is built or overwritten
        raise CheckpointError(
            f"{out_dir} already holds checkpoints of an earlier run (latest: {latest}). Pass "
            f"--resume to continue it, or start fresh in another folder (output_dir=...)."
        )
    resume_from = latest if resume else None
    engine, rollout, ref_engine, critic_engine = _build(job, manager)
    try:
        return _run(job, engine, rollout, ref_engine, critic_engine, resume_from, console)
    finally:
        shutdown = getattr(rollout, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _run(
    job: GRPOJobConfig,
    engine: BaseEngine,
    rollout: BaseRollout,
    ref_engine: BaseEngine | None,
    critic_engine: BaseEngine | None,
    resume_from: str | None,
    console: Console,
) -> dict[str, Any]:
    out_dir = Path(job.output_dir)
    ckpt_root = out_dir / "checkpoints"
    critic_root = out_dir / "critic_checkpoints"
    actor = Actor(job.actor, engine)
    reference = Reference(ref_engine, temperature=job.temperature) if ref_engine else None
    critic = Critic(job.critic, critic_engine) if critic_engine is not None else None
    task = DigitTask(job.task)
    start = 1
    if resume_from is not None:
        start = engine.load_checkpoint(str(resume_from)) + 1
        if critic_engine is not None:
            critic_engine.load_checkpoint(step_dir(critic_root, start - 1))
        task.set_rng_state(load_torch(Path(resume_from) / TRAINER_STATE)["task_rng"])
        console.print(f"resumed from {resume_from} (next step {start})")
    elif job.warmup_sft_steps:
        _warmup(engine, task, job)
    tracker = RunTracker(out_dir, resume_after_step=start - 1)
    rollout.sync_weights(engine.named_full_params())
    params = SamplingParams(
        temperature=job.temperature,
        max_new_tokens=task.response_len,
        n=job.samples_per_prompt,
        stop_token_ids=[EOS],
    )
    ckpt: str | None = str(resume_from) if resume_from is not None else None
    progress = Progress(
        TextColumn("[bold blue]grpo"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "reward {task.fields[reward]:.3f}  loss {task.fields[loss]:+.4f}  {task.fields[tps]:.0f} tok/s"
        ),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    with progress:
        bar = progress.add_task(
            "grpo", total=job.steps, completed=start - 1, reward=0.0, loss=0.0, tps=0.0
        )
        for step in range(start, job.steps + 1):
            row = _step(step, job, task, rollout, actor, reference, critic, engine, params)
            tracker.log(row)
            progress.update(
                bar,
                advance=1,
                reward=row["reward"],
                loss=row["actor/loss"],
                tps=row["tokens_per_s"],
            )
            if step % job.log_every == 0 or step == job.steps:
                console.print(
                    f"step {step:>4}/{job.steps} reward {row['reward']:.3f} "
                    f"pg {row['actor/pg_loss']:+.4f} ent {row['actor/entropy']:.3f} "
                    f"kl {row.get('actor/kl_loss', 0.0):.4f} "
                    f"lp_diff {row['rollout/logprob_diff_max']:.0e} {row['time_s']:.2f}s"
                )
            if step == job.steps or (job.save_every and step % job.save_every == 0):
                if critic_engine is not None:  # first, so an actor checkpoint implies both
                    critic_engine.save_checkpoint(
                        str(critic_root), step=step, max_ckpt_to_keep=job.max_ckpt_to_keep
                    )
                ckpt = _save(engine, task, ckpt_root, step, job.max_ckpt_to_keep)
    hf_export = engine.export_hf(str(out_dir / "hf_export"))
    rows = tracker.rows
    keys = tuple(k for k in PLOT_KEYS if critic is not None or not k.startswith("critic/"))
    title = f"{job.algorithm.upper()} on '{job.task.name}' ({job.steps} steps)"
    plot = tracker.plot(keys, title=title)
    tracker.close()
    rewards = [r["reward"] for r in rows]
    first, last = rewards[: min(10, len(rewards))], rewards[-min(10, len(rewards)) :]
    summary = {
        "steps": job.steps,
        "reward_first10": sum(first) / len(first),
        "reward_last10": sum(last) / len(last),
        "metrics": str(tracker.metrics_path),
        "tensorboard": str(tracker.tensorboard_dir),
        "plot": str(plot),
        "checkpoint": ckpt,
        "hf_export": hf_export,
    }
    _print_summary(console, summary)
    return summary


def _step(
    step: int,
    job: GRPOJobConfig,
    task: DigitTask,
    rollout: BaseRollout,
    actor: Actor,
    reference: Reference | None,
    critic: Critic | None,
    engine: BaseEngine,
    params: SamplingParams,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    prompt = task.prompt_ids(task.sample_digits(job.prompts_per_step))
    prompts = TensorDict(
        {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt)}, batch_size=[len(prompt)]
    )
    # per-step seeds make a resumed run sample exactly what an uninterrupted one would
    gen = rollout.generate(
        prompts, params.model_copy(update={"seed": job.task.seed * 100003 + step})
    )
    response = gen["response_ids"].masked_fill(gen["response_mask"] == 0, 0)
    scores = task.score(gen["prompt_ids"], response)
    batch = _training_batch(gen)
    batch[OLD_LOG_PROBS] = actor.compute_log_prob(batch)[OLD_LOG_PROBS]
    if reference is not None:
        batch[REF_LOG_PROBS] = reference.compute_ref_log_prob(batch)[REF_LOG_PROBS]
    critic_metrics: dict[str, float] = {}
    if critic is None:
        groups = torch.arange(job.prompts_per_step).repeat_interleave(job.samples_per_prompt)
        batch[ADVANTAGES] = grpo_advantages(scores, groups).unsqueeze(1) * batch["loss_mask"]
    else:
        mask = batch["loss_mask"]
        batch[OLD_VALUES] = critic.compute_values(batch)[OLD_VALUES]
        rewards = sequence_to_token_rewards(scores, mask)
        adv, batch[RETURNS] = gae_advantages(
            rewards, batch[OLD_VALUES], mask, gamma=job.gamma, lam=job.lam
        )
        batch[ADVANTAGES] = _whiten(adv, mask)
        critic_metrics = critic.update_critic(batch)
    metrics = actor.update_actor(batch)
    rollout.sync_weights(engine.named_full_params())
    resp_mask = gen["response_mask"].bool()
    trainer_lp = batch[OLD_LOG_PROBS][:, prompt.shape[1] :]
    mismatch = (trainer_lp - gen["rollout_log_probs"]).abs()[resp_mask]
    dt = time.perf_counter() - t0
    return {
        "step": step,
        "reward": float(scores.mean()),
        "response_length": float(resp_mask.sum(-1).float().mean()),
        "rollout/logprob_diff_max": float(mismatch.max()),
        "rollout/logprob_diff_mean": float(mismatch.mean()),
        **metrics,
        **critic_metrics,
        "time_s": dt,
        "tokens_per_s": float(batch["attention_mask"].sum()) / dt,
    }


def _whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero-mean, unit-variance over the masked entries (0 elsewhere)."""
    m = mask.bool()
    vals = x[m]
    std = vals.std(unbiased=False) if vals.numel() > 1 else torch.ones(())
    return ((x - vals.mean()) / (std + eps)) * m


def _save(engine: BaseEngine, task: DigitTask, root: Path, step: int, keep: int | None) -> str:
    folder = Path(engine.save_checkpoint(str(root), step=step, max_ckpt_to_keep=keep))
    tmp = folder / (TRAINER_STATE + ".tmp")
    save_torch({"step": step, "task_rng": task.rng_state()}, tmp)
    tmp.rename(folder / TRAINER_STATE)
    return str(folder)


def _print_summary(console: Console, summary: dict[str, Any]) -> None:
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_row("reward (first 10 steps)", f"{summary['reward_first10']:.3f}")
    table.add_row("reward (last 10 steps)", f"{summary['reward_last10']:.3f}")
    for key in ("metrics", "tensorboard", "plot", "checkpoint", "hf_export"):
        table.add_row(key, str(summary[key]))
    console.print(Panel(table, title="engine-core run: done", expand=False))


def _warmup(engine: BaseEngine, task: DigitTask, job: GRPOJobConfig) -> None:
    from engine_core.train import sft_loss

    engine.set_loss_fn(sft_loss)
    with engine.train_mode():
        for _ in range(job.warmup_sft_steps):
            engine.forward_backward_step(task.supervised_batch(job.warmup_batch_size))
            engine.optimizer_step()
            engine.optimizer_zero_grad()
    engine.set_loss_fn(None)
