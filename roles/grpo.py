"""A GRPO training loop on the shipped digit tasks, through the roles and any engine/rollout.

Each step: generate ``samples_per_prompt`` responses per prompt → score them with the task's
rule-based reward → (reference log-probs) → group-normalized advantages → actor update → weight
sync to the rollout (verified) → log. An optional supervised warm-up runs first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, PositiveInt, ValidationError
from rich.console import Console
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
from engine_core.rollout import BaseRollout
from engine_core.tasks import EOS, DigitTask, TaskConfig
from roles.actor import ADVANTAGES, OLD_LOG_PROBS, REF_LOG_PROBS, Actor, ActorConfig
from roles.advantages import grpo_advantages
from roles.reference import Reference

__all__ = ["GRPOJobConfig", "run_grpo"]


class GRPOJobConfig(FrozenModel):
    """A GRPO run: task, sampling, the actor's engine and update, the rollout."""

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
    engine: dict[str, Any] = Field(..., description="The actor's engine config.")
    rollout: dict[str, Any] = Field(default_factory=lambda: {"backend": "hf"})


def _build(
    job: GRPOJobConfig, manager: PluginManager
) -> tuple[BaseEngine, BaseRollout, BaseEngine | None]:
    spec, engine_cfg = resolve_engine_config(job.engine, manager, path=("engine",))
    engine: BaseEngine = spec.load_class()(engine_cfg)
    engine.init_model()
    rollout_raw = {"model": job.engine["model"], **job.rollout}
    rspec, rollout_cfg = resolve_rollout_config(rollout_raw, manager, path=("rollout",))
    rollout: BaseRollout = rspec.load_class()(rollout_cfg)
    ref_engine = None
    if job.actor.use_kl_loss:
        ref_engine = spec.load_class()(engine_cfg)
        ref_engine.init_model()  # same seed: the initial policy
    return engine, rollout, ref_engine


def _training_batch(out: TensorDict) -> TensorDict:
    prompt, pmask = out["prompt_ids"], out["prompt_mask"]
    resp, rmask = out["response_ids"], out["response_mask"]
    return make_batch(
        torch.cat([prompt, resp], 1),
        torch.cat([pmask, rmask], 1),
        loss_mask=torch.cat([torch.zeros_like(pmask), rmask], 1),
    )


def run_grpo(
    raw: dict[str, Any], manager: PluginManager, *, console: Console | None = None
) -> dict[str, Any]:
    """Run the job in ``raw``; return a summary with the reward curve and the files written."""
    console = console or Console()
    try:
        job = GRPOJobConfig.model_validate(raw)
    except ValidationError as e:
        raise prefix_validation_error(e, (), "GRPOJobConfig") from None
    engine, rollout, ref_engine = _build(job, manager)
    actor = Actor(job.actor, engine)
    reference = Reference(ref_engine, temperature=job.temperature) if ref_engine else None
    task = DigitTask(job.task)
    out_dir = Path(job.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if job.warmup_sft_steps:
        _warmup(engine, task, job)
    rollout.sync_weights(engine.named_full_params())
    params = SamplingParams(
        temperature=job.temperature,
        max_new_tokens=task.response_len,
        n=job.samples_per_prompt,
        stop_token_ids=[EOS],
    )
    rewards: list[float] = []
    with (out_dir / "metrics.jsonl").open("w") as log:
        for step in range(1, job.steps + 1):
            t0 = time.perf_counter()
            digits = task.sample_digits(job.prompts_per_step)
            prompt = task.prompt_ids(digits)
            prompts = TensorDict(
                {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt)},
                batch_size=[len(prompt)],
            )
            gen = rollout.generate(
                prompts, params.model_copy(update={"seed": job.task.seed * 100003 + step})
            )
            response = gen["response_ids"].masked_fill(gen["response_mask"] == 0, 0)
            scores = task.score(gen["prompt_ids"], response)
            batch = _training_batch(gen)
            batch[OLD_LOG_PROBS] = actor.compute_log_prob(batch)[OLD_LOG_PROBS]
            if reference is not None:
                batch[REF_LOG_PROBS] = reference.compute_ref_log_prob(batch)[REF_LOG_PROBS]
            groups = torch.arange(job.prompts_per_step).repeat_interleave(job.samples_per_prompt)
            batch[ADVANTAGES] = grpo_advantages(scores, groups).unsqueeze(1) * batch["loss_mask"]
            metrics = actor.update_actor(batch)
            rollout.sync_weights(engine.named_full_params())
            resp_mask = gen["response_mask"].bool()
            trainer_lp = batch[OLD_LOG_PROBS][:, prompt.shape[1] :]
            mismatch = (trainer_lp - gen["rollout_log_probs"]).abs()[resp_mask]
            row = {
                "step": step,
                "reward": float(scores.mean()),
                "rollout/logprob_diff_max": float(mismatch.max()),
                "rollout/logprob_diff_mean": float(mismatch.mean()),
                "time_s": time.perf_counter() - t0,
                **metrics,
            }
            rewards.append(row["reward"])
            log.write(json.dumps(row) + "\n")
            if step % job.log_every == 0 or step == job.steps:
                console.print(
                    f"step {step:>4}/{job.steps} reward {row['reward']:.3f} "
                    f"pg_loss {metrics['actor/pg_loss']:+.4f} kl {metrics.get('actor/kl_loss', 0.0):.4f} "
                    f"lp_diff {row['rollout/logprob_diff_max']:.1e} {row['time_s']:.2f}s/step"
                )
    first, last = rewards[: min(10, len(rewards))], rewards[-min(10, len(rewards)) :]
    summary = {
        "steps": job.steps,
        "reward_first10": sum(first) / len(first),
        "reward_last10": sum(last) / len(last),
        "metrics": str(out_dir / "metrics.jsonl"),
    }
    console.print_json(json.dumps(summary))
    return summary


def _warmup(engine: BaseEngine, task: DigitTask, job: GRPOJobConfig) -> None:
    from engine_core.train import sft_loss

    engine.set_loss_fn(sft_loss)
    with engine.train_mode():
        for _ in range(job.warmup_sft_steps):
            engine.forward_backward_step(task.supervised_batch(job.warmup_batch_size))
            engine.optimizer_step()
            engine.optimizer_zero_grad()
    engine.set_loss_fn(None)
