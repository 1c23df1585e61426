"""The RL job of ``engine-core run``: GRPO, or PPO with a critic, on text prompts from files
scored by a reward function (``data``, ``reward``: :mod:`engine_core_roles.text`), or on the
built-in digit task's token ids (``task``).

The loop itself is :class:`engine_core_roles.RLTrainer`; this module builds its pieces from one
config (engines, rollout, prompts and reward), and adds what a job needs around
it: an optional supervised warm-up, exact resume, checkpoints, a progress bar, metrics
(JSONL, TensorBoard, a plot), a summary and a Hugging Face export. The rollout runs in this
process or, with ``rollout_placement: process``, in processes of its own
(:mod:`engine_core.remote_rollout`); the weights reach it through one :class:`engine_core_roles.WeightLink`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
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
    ModelConfig,
    PluginManager,
    SamplingParams,
    prefix_validation_error,
    resolve_engine_config,
    resolve_rollout_config,
)
from engine_core.checkpoint import JobCheckpoints, latest_checkpoint
from engine_core.errors import CheckpointError, ConfigError
from engine_core.executors.base import threads_per_process
from engine_core.models import build_hf_config
from engine_core.remote_rollout import ProcessRollout
from engine_core.rollout import BaseRollout
from engine_core_roles.actor import Actor, ActorConfig
from engine_core_roles.agents import (
    EnvConfig,
    Environment,
    EpisodeRollout,
    EpisodeWorker,
    demo_batch,
    load_environment,
)
from engine_core_roles.critic import Critic, CriticConfig
from engine_core_roles.losses import MismatchCorrection
from engine_core_roles.placement import (
    ActorGroup,
    CriticGroup,
    PlacementConfig,
    RayConfig,
    ReferenceGroup,
    RewardModelGroup,
    RoleGroup,
    num_workers,
    start_group,
)
from engine_core_roles.reference import Reference
from engine_core_roles.reward_model import RewardModel
from engine_core_roles.rewards import RewardConfig
from engine_core_roles.tasks import EOS, PAD, DigitTask, TaskConfig
from engine_core_roles.text import (
    DataConfig,
    PromptData,
    StopStrings,
    TextReward,
    load_tokenizer,
    multi_token_stop_strings,
    stop_token_ids,
)
from engine_core_roles.tracking import RunTracker, claim_output_dir, failures_logged
from engine_core_roles.trainer import (
    SEED_STRIDE,
    PolicyRole,
    PromptSource,
    ReferenceRole,
    RewardFn,
    RewardRole,
    RLTrainer,
    SampleReward,
    TrainerConfig,
    ValueRole,
    plot_keys,
)
from engine_core_roles.weights import WeightLink

__all__ = ["RLJobConfig", "run_rl_job"]


class RewardModelJobConfig(FrozenModel):
    """A learned reward on top of the task's rule-based score (weighed by
    ``trainer.reward_model_weight``)."""

    engine: dict[str, Any] = Field(
        ...,
        description="The reward model's engine config: model.path a sequence-classification "
        "checkpoint (one label) over the actor's vocabulary; model.value_head is set to true.",
    )

    def engine_config(self) -> dict[str, Any]:
        model = self.engine.get("model")
        if not isinstance(model, dict):
            return self.engine  # the engine config's own validation names what is missing
        return {**self.engine, "model": {**model, "value_head": True}}


class EvalConfig(FrozenModel):
    """Validation on ``data.val_files``: mean reward and pass@k, logged as ``val/*``."""

    every: int = Field(0, ge=0, description="Evaluate every N steps and at the end (0: never).")
    samples_per_prompt: PositiveInt = Field(
        1, description="k of pass@k: samples per validation prompt (greedy takes 1)."
    )
    greedy: bool = Field(True, description="Greedy decoding; false: at trainer.temperature.")
    max_prompts: PositiveInt | None = Field(None, description="Evaluate the first N only.")
    batch_prompts: PositiveInt = Field(64, description="Prompts per generate call.")

    @model_validator(mode="after")
    def _greedy_once(self) -> EvalConfig:
        if self.greedy and self.samples_per_prompt > 1:
            raise ValueError(
                f"eval.greedy=true gives one answer per prompt, so samples_per_prompt="
                f"{self.samples_per_prompt} would repeat it; set eval.greedy=false to sample "
                f"k answers, or samples_per_prompt=1."
            )
        return self


# the loop's settings that a job config once declared beside TrainerConfig's own
_TRAINER_KEYS = (
    "algorithm",
    "samples_per_prompt",
    "temperature",
    "gamma",
    "lam",
    "max_consecutive_skipped_updates",
)


class RLJobConfig(FrozenModel):
    """An RL run: the loop's settings, the task, the actor's (and critic's) engine, the rollout.

    Every setting lives in one place: the loop's (algorithm, sampling, advantages, staleness,
    the gap guard) in ``trainer`` — a :class:`engine_core_roles.TrainerConfig`, the object a script hands
    to :class:`engine_core_roles.RLTrainer` — the actor's update in ``actor``, the critic's in ``critic``.
    What a section leaves unset and the job derives (the task's response length, TIS for
    asynchronous runs) comes from :meth:`trainer_config` and :meth:`actor_config`; the config
    itself is never changed after validation.
    """

    steps: PositiveInt = 100
    prompts_per_step: PositiveInt = 16
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig,
        description="The loop: algorithm, samples_per_prompt, temperature (the rollout samples "
        "at it and the actor and reference compute their log-probs at it), gamma/lam, seed, "
        "max_staleness, the gap guard. max_new_tokens and stop_token_ids default to the "
        "task's (its response length; stop at EOS).",
    )
    warmup_sft_steps: int = Field(0, ge=0, description="Supervised steps before RL (0: none).")
    warmup_batch_size: PositiveInt = 32
    log_every: PositiveInt = 10
    output_dir: str = "outputs/grpo"
    task: TaskConfig = TaskConfig()
    data: DataConfig | None = Field(
        None,
        description="Prompts from files (the text job): tokenized with the actor's tokenizer "
        "(engine.model.tokenizer or engine.model.path), scored by `reward`. None: the built-in "
        "digit task (`task`).",
    )
    reward: RewardConfig | None = Field(
        None,
        description="The text job's reward function (default: math_answer; with env: none, "
        "the environment's rewards alone).",
    )
    env: EnvConfig | None = Field(
        None,
        description="Multi-turn episodes: the model and this environment take turns (tool "
        "calls, observations) until it ends the episode or a limit does; the reward function "
        "reads the model's last message. Needs data.",
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log_samples: int = Field(
        4, ge=0, description="Decoded samples written to samples.jsonl every log_every steps."
    )
    actor: ActorConfig = Field(
        default_factory=ActorConfig,
        description="The actor's update. Asynchronous runs (trainer.max_staleness >= 1) correct "
        "for their one-version-old samples with mismatch_correction=tis unless it is set.",
    )
    save_every: int = Field(50, ge=0, description="Checkpoint every N steps (0: only at the end).")
    max_ckpt_to_keep: PositiveInt | None = 2
    engine: dict[str, Any] = Field(..., description="The actor's engine config.")
    rollout: dict[str, Any] = Field(default_factory=lambda: {"backend": "hf"})
    rollout_placement: Literal["colocated", "process"] = Field(
        "colocated",
        description="colocated: the rollout runs in this process; process: in processes of its "
        "own (rollout_replicas of them), weights streamed to them over a gloo (NCCL on GPUs) "
        "group and verified per replica.",
    )
    rollout_replicas: PositiveInt = Field(
        1,
        description="rollout_placement=process: rollout processes; each step's prompts are "
        "split across them (a prompt's samples stay in one) and the samples gathered back in "
        "prompt order.",
    )
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig,
        description="Where the actor, critic and reference run: in this process, or as "
        "data-parallel worker groups on local processes or Ray.",
    )
    ray: RayConfig = Field(
        default_factory=RayConfig, description="placement.executor=ray: the cluster to run on."
    )
    critic: CriticConfig = CriticConfig()
    critic_engine: dict[str, Any] | None = Field(
        None,
        description="ppo: the critic's engine config; default: the actor's engine config with "
        "model.value_head=true.",
    )
    reward_model: RewardModelJobConfig | None = Field(
        None,
        description="A reward model scoring every sample as well (placement.reward_model: "
        "where it runs; trainer.reward_model_weight: its weight); None: the task's score alone.",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        moved = {k: f"trainer.{k}" for k in _TRAINER_KEYS if k in data}
        if isinstance(data.get("async"), dict) and "max_staleness" in data["async"]:
            moved["async.max_staleness"] = "trainer.max_staleness"
        if isinstance(data.get("reward_model"), dict) and "weight" in data["reward_model"]:
            moved["reward_model.weight"] = "trainer.reward_model_weight"
        if moved:
            raise ValueError(
                "these settings belong to the loop and live in the trainer section now (one "
                "place each): "
                + ", ".join(f"{old} -> {new}" for old, new in moved.items())
                + "; rename them in the recipe or on the command line."
            )
        return data

    @model_validator(mode="after")
    def _check_algorithm(self) -> RLJobConfig:
        trainer = self.trainer
        if self.data is not None and "task" in self.model_fields_set:
            raise ValueError(
                "both task (the built-in digit task) and data (prompts from files) are set; a "
                "run trains on one: drop one of them."
            )
        if self.data is None and self.reward is not None:
            raise ValueError(
                "reward.fn scores text, but no data is set (the digit task scores itself); add "
                "data.train_files, or drop reward."
            )
        if self.eval.every and (self.data is None or not self.data.val_files):
            raise ValueError(
                f"eval.every={self.eval.every} evaluates on data.val_files, which is not set; "
                f"add data.val_files, or set eval.every=0."
            )
        if self.env is not None and self.data is None:
            raise ValueError(
                "env runs episodes that start from dataset rows, but no data is set; add "
                "data.train_files."
            )
        if self.data is not None and self.warmup_sft_steps and not self.demo_files:
            raise ValueError(
                f"warmup_sft_steps={self.warmup_sft_steps} warms up on demonstrations: with "
                f"data set, give data.demos (or env.demos with env), or set warmup_sft_steps=0."
            )
        if self.env is not None and trainer.filter_groups:
            raise ValueError(
                "trainer.filter_groups draws extra prompts for single responses; it is not "
                "built for episodes yet. Set trainer.filter_groups=false with env."
            )
        if trainer.algorithm == "grpo" and self.critic_engine is not None:
            raise ValueError(
                "critic_engine is set but trainer.algorithm=grpo trains no critic; remove "
                "critic_engine or set trainer.algorithm=ppo."
            )
        if self.reward_model is None and "reward_model_weight" in trainer.model_fields_set:
            raise ValueError(
                "trainer.reward_model_weight is set but no reward_model scores the samples; "
                "add reward_model.engine, or drop trainer.reward_model_weight."
            )
        if self.rollout_replicas > 1 and self.rollout_placement != "process":
            raise ValueError(
                f"rollout_replicas={self.rollout_replicas} runs each replica in a process of its "
                f"own; set rollout_placement=process, or rollout_replicas=1."
            )
        if self.ray.model_fields_set and self.placement.executor != "ray":
            raise ValueError(
                f"ray.{sorted(self.ray.model_fields_set)[0]} is set but placement.executor="
                f"{self.placement.executor}; set placement.executor=ray, or drop the ray block."
            )
        if trainer.max_staleness and self.rollout_placement != "process":
            raise ValueError(
                f"trainer.max_staleness={trainer.max_staleness} generates while the actor "
                f"trains, which needs the rollout in a process of its own; set "
                f"rollout_placement=process, or trainer.max_staleness=0."
            )
        return self

    def trainer_config(self, task: DigitTask) -> TrainerConfig:
        """The loop's settings: ``trainer``, with the task's response length and its stop token
        where ``trainer`` leaves max_new_tokens and stop_token_ids unset."""
        derived = {"max_new_tokens": task.response_len, "stop_token_ids": [EOS]}
        unset = {k: v for k, v in derived.items() if k not in self.trainer.model_fields_set}
        return self.trainer.model_copy(update=unset)

    def text_trainer_config(self, stops: list[int]) -> TrainerConfig:
        """The loop's settings of a text job: ``trainer``, stopping at ``stops`` (the
        tokenizer's EOS, its chat template's end of turn and data.stop_strings' tokens) where
        ``trainer`` leaves stop_token_ids unset."""
        if "stop_token_ids" in self.trainer.model_fields_set:
            return self.trainer
        return self.trainer.model_copy(update={"stop_token_ids": stops})

    def actor_config(self) -> ActorConfig:
        """The actor's settings: ``actor``, with TIS for an asynchronous run that leaves
        mismatch_correction unset (its samples are one version old: off-policy by
        construction; 0.772 without it against 0.848 with it at 500 steps)."""
        if self.trainer.max_staleness and "mismatch_correction" not in self.actor.model_fields_set:
            return self.actor.model_copy(update={"mismatch_correction": MismatchCorrection.TIS})
        return self.actor

    @property
    def demo_files(self) -> list[str]:
        """The warm-up's demonstration files: data.demos, then env.demos."""
        return [*(self.data.demos if self.data else []), *(self.env.demos if self.env else [])]

    def critic_engine_config(self) -> dict[str, Any]:
        if self.critic_engine is not None:
            return self.critic_engine
        return {**self.engine, "model": {**self.engine["model"], "value_head": True}}


@dataclass
class _Roles:
    """The job's roles as the trainer calls them, and what holds their engines."""

    actor: PolicyRole
    rollout: BaseRollout | ProcessRollout
    reference: ReferenceRole | None
    critic: ValueRole | None
    parts: dict[str, Any]  # checkpoint parts: engines, or role groups
    reward_model: RewardRole | None = None
    groups: dict[str, RoleGroup] = field(default_factory=dict)  # by placement role name
    owns_ray: bool = False
    weights: WeightLink | None = None  # the one path from the actor to the rollout

    @property
    def actor_part(self) -> Any:
        return self.parts["actor"]

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()
        if isinstance(self.rollout, ProcessRollout):
            self.rollout.shutdown()
        for group in self.groups.values():
            group.shutdown()
        if self.owns_ray:
            import ray

            ray.shutdown()


@dataclass(frozen=True)
class _Threads:
    """The job's CPU threads, decided here and nowhere else: this process's count while the
    job runs (None: left as it is) and each rollout replica's."""

    driver: int | None
    per_replica: int


def _threads(job: RLJobConfig) -> _Threads:
    if job.rollout_placement != "process":
        return _Threads(None, 1)
    driver = None
    if job.trainer.max_staleness:
        # generation and training run at once: the cores are split between this process and
        # the rollout's, not every process on every core
        driver = threads_per_process(2)
    cores = driver or torch.get_num_threads()
    return _Threads(driver, threads_per_process(job.rollout_replicas, cores))


@dataclass
class _Text:
    """The text job's pieces, built (and checked) before any engine is."""

    tokenizer: Any
    train: PromptData
    reward: TextReward
    stops: list[int]
    val: PromptData | None = None
    environment: Callable[[], Environment] | None = None
    tools: list[dict[str, Any]] | None = None
    context: int | None = None  # the model's context length
    stop_strings: StopStrings | None = None  # ends responses at multi-token stop strings
    val_reward: TextReward | None = None


def _text(job: RLJobConfig, console: Console) -> _Text | None:
    """Tokenizer, datasets and reward of a job with ``data``; None for the digit task. Every
    input problem is refused here, before anything is built or trained."""
    if job.data is None:
        return None
    try:
        model = ModelConfig.model_validate(job.engine.get("model"))
    except ValidationError as e:
        raise prefix_validation_error(e, ("engine", "model"), "ModelConfig") from None
    hf_config = build_hf_config(model)
    tokenizer = load_tokenizer(model, getattr(hf_config, "vocab_size", None))
    context = getattr(hf_config, "max_position_embeddings", None)
    room = None if context is None else int(context) - job.trainer.max_new_tokens
    if room is not None and room < 1:
        raise ConfigError(
            f"trainer.max_new_tokens={job.trainer.max_new_tokens} leaves no room for a prompt "
            f"in the model's context ({context} tokens); lower it."
        )
    limits = [v for v in (job.data.max_prompt_length, room) if v is not None]
    limit = min(limits) if limits else 1 << 30
    reward_cfg = job.reward or (None if job.env is not None else RewardConfig())
    environment, probe, tools = None, None, None
    if job.env is not None:
        environment = load_environment(job.env, prompt_key=job.data.prompt_key)
        probe = environment()  # one instance for the tools and the check below
        tools = probe.tools
    rows = environment is not None
    train = PromptData(
        job.data.train_files, tokenizer, job.data, max_length=limit, tools=tools, rows=rows
    )
    stops = stop_token_ids(tokenizer, job.data.stop_strings)
    longer = multi_token_stop_strings(tokenizer, job.data.stop_strings)
    if longer and job.env is not None:
        raise ConfigError(
            f"data.stop_strings {longer} are several tokens of this tokenizer; with env an "
            f"episode's turns stop on token ids only. Give single-token stop strings, or drop "
            f"them."
        )
    if "stop_token_ids" in job.trainer.model_fields_set and job.data.stop_strings:
        raise ConfigError(
            "both trainer.stop_token_ids and data.stop_strings are set; give the stops in one "
            "place (trainer.stop_token_ids replaces the tokenizer's own)."
        )
    reward = TextReward(reward_cfg, tokenizer, train, show=job.log_samples)
    text = _Text(tokenizer, train, reward, stops, environment=environment, tools=tools)
    text.stop_strings = StopStrings(tokenizer, longer) if longer else None
    text.context = None if context is None else int(context)
    sets = [("data.train_files", train)]
    if job.data.val_files:
        text.val = PromptData(
            job.data.val_files,
            tokenizer,
            job.data,
            max_length=limit,
            what="data.val_files",
            tools=tools,
            rows=rows,
        )
        text.val_reward = TextReward(reward_cfg, tokenizer, text.val, show=0)
        sets.append(("data.val_files", text.val))
    for what, data in sets:
        dropped = f"; {data.dropped} longer than {limit} tokens dropped" if data.dropped else ""
        console.print(f"{what}: {len(data)} prompts{dropped}")
    text.reward.check()
    if probe is not None:
        _check_environment(probe, train)
    return text


def _check_environment(env: Environment, data: PromptData) -> None:
    """Start an episode on the first row before training: an environment whose ``reset``
    fails or returns something other than messages is an error now, not at the first step."""
    from engine_core_roles.agents import ROW, check_messages, check_template

    row = data.batch([0])[ROW].tolist()[0]
    try:
        first = env.reset(row)
    except Exception as e:
        raise ConfigError(
            f"env: {type(env).__name__}.reset raised {type(e).__name__}: {e} on the first row "
            f"of {data.what}; checked before training."
        ) from e
    check_messages(first, f"env: {type(env).__name__}.reset")
    # the chat template must render an observation after a turn the same way whatever came
    # before it: checked now rather than at the first observation
    check_template(data.tokenizer, env.tools)


def _build(
    job: RLJobConfig,
    manager: PluginManager,
    stack: contextlib.ExitStack,
    threads: _Threads,
    text: _Text | None = None,
) -> _Roles:
    # every config is resolved (and refused, naming the field) before anything is built
    spec, engine_cfg = resolve_engine_config(job.engine, manager, path=("engine",))
    rollout_raw = {"model": job.engine["model"], **job.rollout}
    rspec, rollout_cfg = resolve_rollout_config(rollout_raw, manager, path=("rollout",))
    critic_spec = critic_cfg = None
    if job.trainer.algorithm == "ppo":
        path = ("critic_engine",)
        critic_spec, critic_cfg = resolve_engine_config(
            job.critic_engine_config(), manager, path=path
        )
    rm_spec = rm_cfg = None
    if job.reward_model is not None:
        rm_spec, rm_cfg = resolve_engine_config(
            job.reward_model.engine_config(), manager, path=("reward_model", "engine")
        )
        _check_vocabulary(engine_cfg, rm_cfg)
    roles = _Roles(actor=None, rollout=None, reference=None, critic=None, parts={})  # type: ignore[arg-type]
    stack.callback(roles.close)
    if job.placement.grouped:
        _build_groups(job, roles, engine_cfg, critic_cfg, rm_cfg)
    else:
        engine: BaseEngine = spec.load_class()(engine_cfg)
        engine.init_model()
        roles.actor, roles.parts["actor"] = Actor(job.actor_config(), engine), engine
        if job.actor.use_kl_loss:
            ref_engine = spec.load_class()(engine_cfg)
            ref_engine.init_model()  # same seed: the initial policy
            roles.reference = Reference(ref_engine)
        if critic_spec is not None:
            critic_engine = critic_spec.load_class()(critic_cfg)
            critic_engine.init_model()
            roles.critic, roles.parts["critic"] = Critic(job.critic, critic_engine), critic_engine
        if rm_spec is not None:
            rm_engine = rm_spec.load_class()(rm_cfg)
            rm_engine.init_model()
            roles.reward_model = RewardModel(rm_engine)
    episodes = _episode_settings(job, text)
    if job.rollout_placement == "process":
        # with the roles on Ray, the replicas are Ray actors too (placed by Ray, like the roles);
        # with an environment, each replica runs its episodes whole
        hosting: dict[str, Any] = {}  # the replicas' worker: the plain one unless episodes
        if episodes:
            hosting = {"worker_cls": EpisodeWorker, "worker_args": (episodes,)}
        roles.rollout = ProcessRollout(
            rollout_cfg,  # type: ignore[arg-type]
            replicas=job.rollout_replicas,
            executor="ray" if job.placement.executor == "ray" else "local",
            threads_per_replica=threads.per_replica,
            **hosting,
        )
    else:
        backend: BaseRollout = rspec.load_class()(rollout_cfg)
        roles.rollout = backend
        if episodes and text is not None and text.environment is not None:
            assert job.env is not None
            roles.rollout = EpisodeRollout(
                backend,
                text.environment,
                text.tokenizer,
                max_turns=job.env.max_turns,
                max_episode_tokens=episodes["max_episode_tokens"],
                step_timeout_s=job.env.step_timeout_s,
            )
    roles.weights = WeightLink(roles.actor, roles.rollout)  # type: ignore[arg-type]
    return roles


def _episode_settings(job: RLJobConfig, text: _Text | None) -> dict[str, Any] | None:
    """What an episode rollout needs beside the rollout's config (None: no environment)."""
    if job.env is None or text is None or job.data is None:
        return None
    budget = job.env.max_episode_tokens or text.context
    if budget is None:
        raise ConfigError(
            "the model's config gives no context length (max_position_embeddings); set "
            "env.max_episode_tokens."
        )
    if text.context is not None and budget > text.context:
        raise ConfigError(
            f"env.max_episode_tokens={budget} is more than the model's context "
            f"({text.context} tokens); lower it."
        )
    return {
        "env": job.env.model_dump(),
        "prompt_key": job.data.prompt_key,
        "max_episode_tokens": int(budget),
    }


def _check_vocabulary(policy_cfg: Any, rm_cfg: Any) -> None:
    """A reward model reads the actor's token ids: the two must share one vocabulary."""
    policy = build_hf_config(policy_cfg.model).vocab_size
    rm = build_hf_config(rm_cfg.model).vocab_size
    if policy != rm:
        raise ConfigError(
            f"reward_model.engine.model has vocab_size {rm}, the actor's model {policy}; the "
            f"reward model scores the actor's token ids, so it must use the same tokenizer. "
            f"Train or pick a reward model on the actor's vocabulary."
        )


def _build_groups(
    job: RLJobConfig, roles: _Roles, engine_cfg: Any, critic_cfg: Any, rm_cfg: Any
) -> None:
    """The roles as worker groups on ``job.placement.executor`` (local processes or Ray)."""
    from engine_core_roles.workers import (
        ActorWorker,
        CriticWorker,
        ReferenceWorker,
        RewardModelWorker,
    )

    placement = job.placement
    if placement.executor == "ray":
        import ray

        if not ray.is_initialized():
            ray.init(address=job.ray.address, num_cpus=job.ray.num_cpus, log_to_driver=False)
            roles.owns_ray = True
    policy_raw, actor_cfg = engine_cfg.model_dump(), job.actor_config()
    actor = start_group(
        placement,
        ActorWorker,
        num_workers(placement.actor.dp, engine_cfg),
        (policy_raw, actor_cfg.model_dump()),
    )
    roles.groups["actor"] = ActorGroup(actor, actor_cfg)
    roles.actor = roles.parts["actor"] = roles.groups["actor"]  # type: ignore[assignment]
    if job.actor.use_kl_loss:
        workers = num_workers(placement.reference.dp, engine_cfg)
        ref = start_group(placement, ReferenceWorker, workers, (policy_raw,))
        roles.groups["reference"] = ReferenceGroup(ref)
        roles.reference = roles.groups["reference"]  # type: ignore[assignment]
    if critic_cfg is not None:
        workers = num_workers(placement.critic.dp, critic_cfg)
        critic_args = (critic_cfg.model_dump(), job.critic.model_dump())
        critic = start_group(placement, CriticWorker, workers, critic_args)
        roles.groups["critic"] = CriticGroup(critic)
        roles.critic = roles.parts["critic"] = roles.groups["critic"]  # type: ignore[assignment]
    if rm_cfg is not None:
        workers = num_workers(placement.reward_model.dp, rm_cfg)
        rm = start_group(placement, RewardModelWorker, workers, (rm_cfg.model_dump(),))
        roles.groups["reward_model"] = RewardModelGroup(rm)
        roles.reward_model = roles.groups["reward_model"]  # type: ignore[assignment]
    for role, group in roles.groups.items():
        want = getattr(placement, role).dp
        if group.dp_size != want:
            raise ConfigError(
                f"placement.{role}.dp={want}, but its engine formed dp={group.dp_size} from "
                f"{group.group.num_workers} workers; the engine's tensor_parallel_size × "
                f"pipeline_parallel_size must divide them. Check the role's engine config."
            )


def run_rl_job(
    raw: dict[str, Any],
    manager: PluginManager,
    *,
    resume: bool = False,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the job in ``raw``; with ``resume``, continue from the latest checkpoint in its output_dir."""
    console = console or Console()
    try:
        job = RLJobConfig.model_validate(raw)
    except ValidationError as e:
        raise prefix_validation_error(e, (), "RLJobConfig") from None
    out_dir = Path(job.output_dir)
    ckpt_root = out_dir / "checkpoints"
    latest = latest_checkpoint(ckpt_root)
    if resume and latest is None:
        raise CheckpointError(
            f"--resume: no checkpoint under {ckpt_root}; run without --resume to start fresh."
        )
    # refused before anything is built or overwritten: a folder holding another run, or one
    # that cannot be written
    claim_output_dir(out_dir, command="engine-core run", resume=resume)
    resume_from = None
    if resume:
        resume_from = _resume_point(job, console)
    text = _text(job, console)
    threads = _threads(job)
    before = torch.get_num_threads()
    safe = f"checkpoints already saved under {ckpt_root} are kept, and --resume continues"
    try:
        with (
            failures_logged(out_dir, command="engine-core run", safe=safe),
            contextlib.ExitStack() as stack,
        ):
            if threads.driver is not None and threads.driver != before:
                torch.set_num_threads(threads.driver)
            roles = _build(job, manager, stack, threads, text)
            return _run(job, roles, resume_from, console, text)
    finally:
        # only when changed: setting it at all, even to the same count, slows this process's
        # later CPU kernels (measured: 15% on the recipe's model)
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _run(
    job: RLJobConfig,
    roles: _Roles,
    resume_from: str | None,
    console: Console,
    text: _Text | None = None,
) -> dict[str, Any]:
    out_dir = Path(job.output_dir)
    task = DigitTask(job.task)
    reward_fn: RewardFn | SampleReward
    if text is None:
        trainer_cfg = job.trainer_config(task)
        reward_fn = lambda prompt, response, mask: task.score(  # noqa: E731
            prompt, response.masked_fill(mask == 0, PAD)
        )
        prompts: PromptSource = lambda step: task.prompt_ids(  # noqa: E731
            task.sample_digits(job.prompts_per_step)
        )
    else:
        trainer_cfg = job.text_trainer_config(text.stops)
        reward_fn, train = text.reward, text.train
        prompts = lambda step: train.next_batch(job.prompts_per_step)  # noqa: E731

    def position() -> dict[str, Any]:
        """Where the prompts continue: the digit task's sampler, or the dataset position."""
        return {"task_rng": task.rng_state()} if text is None else {"data": text.train.state_dict()}

    trainer = RLTrainer(
        trainer_cfg,
        actor=roles.actor,
        rollout=roles.rollout,
        reward_fn=reward_fn,
        prompts=prompts,
        reference=roles.reference,
        critic=roles.critic,
        reward_model=roles.reward_model,
        weights=roles.weights,
        responses=None if text is None else text.stop_strings,
    )
    checkpoints = JobCheckpoints(out_dir / "checkpoints", max_ckpt_to_keep=job.max_ckpt_to_keep)
    parts = roles.parts
    if resume_from is not None:
        job_state = checkpoints.load(resume_from, parts, verified=True)  # _resume_point did
        where = "task_rng" if text is None else "data"
        if not isinstance(job_state.get("trainer"), dict) or where not in job_state:
            raise CheckpointError(
                f"{resume_from} holds no job position (trainer, {where}); it was not saved by "
                f"engine-core run with this job's {'task' if text is None else 'data'}. Resume "
                f"from another checkpoint, or with the settings that saved it."
            )
        trainer.load_state_dict(job_state["trainer"])
        if text is None:
            task.set_rng_state(job_state["task_rng"])
        else:
            text.train.load_state_dict(job_state["data"])
        console.print(f"resumed from {resume_from} (next step {trainer.global_step + 1})")
    elif job.warmup_sft_steps and text is not None:
        _warmup_demos(roles.actor_part, text, job)
    elif job.warmup_sft_steps:
        _warmup(roles.actor_part, task, job)
    tracker = RunTracker(out_dir, resume_after_step=trainer.global_step)
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

    def log(trainer: RLTrainer, row: dict[str, Any]) -> None:
        step = row["step"]
        shown = row.pop("samples", None)
        every = job.eval.every
        if text is not None and every and (step % every == 0 or step == job.steps):
            row.update(_evaluate(trainer, text, job, step))
        tracker.log(row)
        nan = float("nan")
        progress.update(
            bar,
            advance=1,
            reward=row["reward"],
            loss=row.get("actor/loss", nan),
            tps=row["tokens_per_s"],
        )
        if step % job.log_every == 0 or step == job.steps:
            if shown:
                tracker.log_samples(step, shown)
            val = "".join(f" {k} {v:.3f}" for k, v in row.items() if k.startswith("val/"))
            console.print(
                f"step {step:>4}/{job.steps} reward {row['reward']:.3f} "
                f"pg {row.get('actor/pg_loss', nan):+.4f} ent {row.get('actor/entropy', nan):.3f} "
                f"kl {row.get('actor/kl_loss', 0.0):.4f} "
                f"lp_diff {row.get('rollout/logprob_diff_max', nan):.0e} {row['time_s']:.2f}s" + val
            )

    def save(trainer: RLTrainer, row: dict[str, Any]) -> None:
        nonlocal ckpt
        step = row["step"]
        if step == job.steps or (job.save_every and step % job.save_every == 0):
            # actor, critic and the task position: one folder, committed by one rename
            # (and, asynchronous, the generation in flight: a resume trains on the same samples)
            state = {**position(), "trainer": trainer.state_dict()}
            ckpt = checkpoints.save(step, parts, state)

    with progress:
        bar = progress.add_task(
            "grpo", total=job.steps, completed=trainer.global_step, reward=0.0, loss=0.0, tps=0.0
        )
        try:
            trainer.fit(job.steps, callbacks=[log, save])
        finally:
            trainer.close()
    hf_export = roles.actor_part.export_hf(str(out_dir / "hf_export"))
    if text is not None:  # a folder that from_pretrained and the tokenizer both load
        text.tokenizer.save_pretrained(hf_export)
    rows = tracker.rows
    what = (
        job.task.name if job.data is None else ", ".join(Path(f).name for f in job.data.train_files)
    )
    title = f"{job.trainer.algorithm.upper()} on '{what}' ({job.steps} steps)"
    plot = tracker.plot(plot_keys(rows), title=title)
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
    val_keys = [k for r in rows for k in r if k.startswith("val/pass@")]
    if val_keys:
        key = max(set(val_keys), key=lambda k: (k != "val/pass@1", k))  # pass@k over pass@1
        best = max((r for r in rows if key in r), key=lambda r: r[key])
        summary.update(
            {"best_val": best[key], "best_val_metric": key, "best_val_step": best["step"]}
        )
    _print_summary(console, summary)
    return summary


EVAL_SEED_OFFSET = 7919  # sampled evaluation: seeds of its own, apart from the training steps


def _evaluate(trainer: RLTrainer, text: _Text, job: RLJobConfig, step: int) -> dict[str, float]:
    """Mean reward and pass@k on the validation prompts, with the rollout's current weights
    (the latest update's). A sample counts as solved at reward >= reward.success_threshold;
    pass@k is the share of prompts with a solved sample among k, pass@1 the share of samples
    solved."""
    assert text.val is not None and text.val_reward is not None
    cfg, k = job.eval, job.eval.samples_per_prompt
    base = trainer.config
    seed = None if base.seed is None else base.seed * SEED_STRIDE + EVAL_SEED_OFFSET + step
    params = SamplingParams(
        temperature=0.0 if cfg.greedy else base.temperature,
        max_new_tokens=base.max_new_tokens,
        n=k,
        stop_token_ids=list(base.stop_token_ids),
        seed=None if cfg.greedy else seed,
    )
    threshold = (job.reward or RewardConfig()).success_threshold
    scores, failed, seen = [], 0, 0
    for batch in text.val.batches(cfg.batch_prompts):
        if cfg.max_prompts is not None and seen >= cfg.max_prompts:
            break
        if cfg.max_prompts is not None and seen + batch.batch_size[0] > cfg.max_prompts:
            batch = batch[: cfg.max_prompts - seen]
        seen += int(batch.batch_size[0])
        rewards = text.val_reward(batch, trainer.generate(batch, params))
        failed += len(rewards.failures)
        scores.append(torch.nan_to_num(rewards.scores, nan=0.0).view(-1, k))
    table = torch.cat(scores)
    solved = table >= threshold
    out = {
        "val/reward": float(table.mean()),
        "val/pass@1": float(solved.float().mean()),
    }
    if k > 1:
        out[f"val/pass@{k}"] = float(solved.any(-1).float().mean())
    if failed:
        out["val/failed_samples"] = float(failed)
    return out


def _resume_point(job: RLJobConfig, console: Console) -> str:
    """The newest step whose checkpoint (actor, critic under ppo, job state) verifies; newer
    ones are set aside (renamed ``*.rejected``, kept) and the console says which and why."""
    names = ["actor", "critic"] if job.trainer.algorithm == "ppo" else ["actor"]
    root = Path(job.output_dir) / "checkpoints"
    try:
        folder, skipped = JobCheckpoints(root).newest_verified(names)
    except CheckpointError as e:
        raise CheckpointError(f"--resume: {e}") from None
    for step, reason, moved in skipped:
        console.print(
            f"[yellow]--resume: skipped step {step}: {reason} Set aside as {moved}.[/yellow]",
            soft_wrap=True,
        )
    return folder


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


def _supervised(actor_part: Any) -> Callable[[TensorDict], float]:
    """One supervised step of the actor, wherever it is: its engine in this process, or its
    worker group (each DP rank on its share of the batch)."""
    from engine_core_roles.train import supervised_step

    if isinstance(actor_part, BaseEngine):
        return functools.partial(supervised_step, actor_part)
    step: Callable[[TensorDict], float] = actor_part.supervised_step
    return step


def _warmup_demos(actor_part: Any, text: _Text, job: RLJobConfig) -> None:
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
    step = _supervised(actor_part)
    for _ in range(job.warmup_sft_steps):
        pick = torch.randint(len(episodes), (job.warmup_batch_size,), generator=gen).tolist()
        step(demo_batch(text.tokenizer, text.tools, [episodes[i] for i in pick]))


def _warmup(actor_part: Any, task: DigitTask, job: RLJobConfig) -> None:
    step = _supervised(actor_part)
    for _ in range(job.warmup_sft_steps):
        step(task.supervised_batch(job.warmup_batch_size))
