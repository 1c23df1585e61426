"""``RLJobConfig``: one ``engine-core run`` recipe, validated whole before anything is built."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from engine_core import (
    FrozenModel,
    LossAggregation,
)
from engine_core.hookspecs import AlgorithmNeed
from engine_core_roles.algorithms.losses import MismatchCorrection
from engine_core_roles.algorithms.select import resolve_algorithm
from engine_core_roles.data.datasets.prompts import DataConfig
from engine_core_roles.data.rewards.functions import RewardConfig
from engine_core_roles.data.tasks.digits import EOS, DigitTask
from engine_core_roles.distributed.placement import (
    PlacementConfig,
    RayConfig,
)
from engine_core_roles.episodes.config import EnvConfig
from engine_core_roles.jobs.config import JobConfig
from engine_core_roles.models.actor import ActorConfig
from engine_core_roles.models.critic import CriticConfig
from engine_core_roles.trainer.config import TrainerConfig, check_routing_replay

__all__ = ["RewardModelJobConfig", "EvalConfig", "RLJobConfig"]


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


class RLJobConfig(JobConfig):
    """An RL run: the loop's settings, the task, the actor's (and critic's) engine, the rollout.

    Every setting lives in one place: the loop's (algorithm, sampling, advantages, staleness,
    the gap guard) in ``trainer`` — a :class:`engine_core_roles.TrainerConfig`, the object a script hands
    to :class:`engine_core_roles.RLTrainer` — the actor's update in ``actor``, the critic's in ``critic``.
    What a section leaves unset and the job derives (the task's response length, TIS for
    asynchronous runs) comes from :meth:`trainer_config` and :meth:`actor_config`; the config
    itself is never changed after validation.
    """

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
    warmup_lr: PositiveFloat | None = Field(
        None,
        description="The warm-up's learning rate, RL then running at engine.optim.lr (whose "
        "schedule counts RL's updates only); None: one schedule over both, the warm-up's "
        "steps first.",
    )
    output_dir: str = "outputs/rl"
    data: DataConfig | None = Field(
        None,
        description="Prompts from files (the text job): tokenized with the actor's tokenizer "
        "(engine.model.tokenizer or engine.model.path), scored by `reward`. None: the built-in "
        "digit task (`task`).",
    )
    reward: RewardConfig | None = Field(
        None,
        description="The text job's reward function (default: math_answer; with env: none, "
        "the environment's rewards alone; with agent: none, the agents' returns alone).",
    )
    env: EnvConfig | None = Field(
        None,
        description="Multi-turn episodes: the model and this environment take turns (tool "
        "calls, observations) until it ends the episode or a limit does; the reward function "
        "reads the model's last message. Needs data.",
    )
    agent: str | None = Field(
        None,
        description="Agents written with any OpenAI client instead of env: the import path "
        "('pkg.module:function' or 'path/to/file.py:function') of an async function "
        "agent(base_url, api_key, sample) -> reward (a number, None: reward.fn scores the "
        "session's last reply, or a dict with 'reward' and counts to log). Each sample runs it "
        "once, against a session of the job's own endpoint (in this process, in front of the "
        "rollout wherever rollout_placement puts it; with rollout_placement=process, "
        "trainer.max_staleness >= 1 runs step t+1's agents while step t trains); needs data.",
    )
    agent_concurrency: PositiveInt = Field(
        32, description="Agents running at once (their calls to the model are batched)."
    )
    agent_timeout_s: PositiveFloat = Field(
        600.0, description="An agent running longer is cancelled: an error, scored 0."
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
    rollout_python: str | None = Field(
        None,
        description="rollout_placement=process: the Python interpreter the replicas run in (e.g. "
        ".venv-sglang/bin/python: an environment of their own, with its own torch), which "
        "needs engine-core and the rollout's plugin installed. Requests, results and weights "
        "then cross as plain data and raw tensor bytes over pipes, weights relayed by this "
        "process and verified by every replica. null: this interpreter.",
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
        self._check_agent()
        if self.data is not None and self.warmup_sft_steps and not self.demo_files:
            raise ValueError(
                f"warmup_sft_steps={self.warmup_sft_steps} warms up on demonstrations: with "
                f"data set, give data.demos (or env.demos with env), or set warmup_sft_steps=0."
            )
        if self.warmup_lr is not None:
            self._check_warmup_lr()
        if self.env is not None and trainer.filter_groups:
            raise ValueError(
                "trainer.filter_groups draws extra prompts for single responses; it is not "
                "built for episodes yet. Set trainer.filter_groups=false with env."
            )
        if self.critic_engine is not None and not self.needs_critic:
            raise ValueError(
                f"critic_engine is set but trainer.algorithm ({trainer.algorithm.name}: advantage "
                f"{trainer.algorithm.advantage}) trains no critic; remove critic_engine or set "
                f"trainer.algorithm=ppo."
            )
        overlong = trainer.algorithm.overlong
        if overlong is not None and overlong.buffer >= self.generation_budget:
            raise ValueError(
                f"trainer.algorithm.overlong.buffer={overlong.buffer} must be below the "
                f"generation budget ({self.generation_budget} tokens: trainer.max_new_tokens, or "
                f"the task's response length); lower the buffer."
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
        if self.rollout_python is not None and self.rollout_placement != "process":
            raise ValueError(
                f"rollout_python={self.rollout_python!r} starts the rollout replicas in that "
                f"interpreter; set rollout_placement=process, or drop rollout_python."
            )
        if self.rollout_python is not None and self.placement.executor == "ray":
            raise ValueError(
                f"rollout_python={self.rollout_python!r} runs the replicas as local processes, "
                f"but placement.executor=ray places them on Ray; use placement.executor=local "
                f"(or in_process), or drop rollout_python."
            )
        if self.ray.model_fields_set and self.placement.executor != "ray":
            raise ValueError(
                f"ray.{sorted(self.ray.model_fields_set)[0]} is set but placement.executor="
                f"{self.placement.executor}; set placement.executor=ray, or drop the ray block."
            )
        self._check_routing_replay()
        if trainer.max_staleness and self.rollout_placement != "process":
            raise ValueError(
                f"trainer.max_staleness={trainer.max_staleness} generates while the actor "
                f"trains, which needs the rollout in a process of its own; set "
                f"rollout_placement=process, or trainer.max_staleness=0."
            )
        return self

    def _check_agent(self) -> None:
        """``agent`` runs with what it is built for, and its settings only with it."""
        if self.agent is None:
            unused = {"agent_concurrency", "agent_timeout_s"} & self.model_fields_set
            if unused:
                raise ValueError(
                    f"{', '.join(sorted(unused))} set, but no agent runs; set agent, or drop them."
                )
            return
        agent = f"agent={self.agent!r}"
        refused = [
            (
                self.env is not None,
                f"{agent} and env are both set; a run trains agents or environment episodes: "
                f"drop one of them",
            ),
            (
                self.data is None,
                f"{agent} starts from dataset rows, but no data is set; add data.train_files",
            ),
        ]
        for bad, message in refused:
            if bad:
                raise ValueError(message + ".")

    @property
    def needs_reference(self) -> bool:
        """Whether the run computes reference log-probs: a KL loss, KL in the reward, or an
        algorithm that reads them."""
        if self.actor.use_kl_loss or self.trainer.algorithm.kl_in_reward is not None:
            return True
        return AlgorithmNeed.REFERENCE in resolve_algorithm(self.trainer.algorithm).needs

    @property
    def needs_critic(self) -> bool:
        """Whether the run's advantage estimator needs a critic (the job then builds one)."""
        resolved = resolve_algorithm(self.trainer.algorithm)
        return AlgorithmNeed.CRITIC in resolved.needs

    def _check_routing_replay(self) -> None:
        mode = self.trainer.routing_replay
        if mode == "off":
            return
        check_routing_replay(mode, self.actor_config().old_log_probs_from_update)

    def trainer_config(self, task: DigitTask) -> TrainerConfig:
        """The loop's settings: ``trainer``, with the task's response length and its stop token
        where ``trainer`` leaves max_new_tokens and stop_token_ids unset."""
        derived = {"max_new_tokens": task.response_len, "stop_token_ids": [EOS]}
        unset = {k: v for k, v in derived.items() if k not in self.trainer.model_fields_set}
        return self.trainer.validated_copy(**unset)

    def text_trainer_config(self, stops: list[int]) -> TrainerConfig:
        """The loop's settings of a text job: ``trainer``, stopping at ``stops`` (the
        tokenizer's EOS and its chat template's end of turn) where
        ``trainer`` leaves stop_token_ids unset."""
        if "stop_token_ids" in self.trainer.model_fields_set:
            return self.trainer
        return self.trainer.validated_copy(stop_token_ids=stops)

    def actor_config(self, max_new_tokens: int | None = None) -> ActorConfig:
        """The actor's settings: ``actor``, with the generation budget ``max_new_tokens`` as
        loss_norm_length where ``trainer.algorithm`` aggregates with seq-mean-token-sum-norm
        and ``actor`` leaves it unset, and TIS for an asynchronous run that leaves
        mismatch_correction unset (its samples are one version old: off-policy by
        construction; 0.772 without it against 0.848 with it at 500 steps). The policy loss
        and its aggregation are ``trainer.algorithm``'s, handed to the actor beside this."""
        given = self.actor.model_fields_set
        update: dict[str, Any] = {}
        if self.trainer.max_staleness and "mismatch_correction" not in given:
            update["mismatch_correction"] = MismatchCorrection.TIS
        mode = self.trainer.algorithm.loss_agg_mode
        if mode == LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM and "loss_norm_length" not in given:
            update["loss_norm_length"] = max_new_tokens or self.generation_budget
        return self.actor.validated_copy(**update)

    @property
    def generation_budget(self) -> int:
        """The most tokens a response may have: trainer.max_new_tokens, or (left unset on the
        digit task) the task's response length."""
        if self.data is None and "max_new_tokens" not in self.trainer.model_fields_set:
            return DigitTask(self.task).response_len
        return self.trainer.max_new_tokens

    @property
    def demo_files(self) -> list[str]:
        """The warm-up's demonstration files: data.demos, then env.demos."""
        return [*(self.data.demos if self.data else []), *(self.env.demos if self.env else [])]

    def _check_warmup_lr(self) -> None:
        optim = self.engine.get("optim") or {}
        set_there = [k for k in ("prelude_steps", "prelude_lr") if k in optim]
        if set_there:
            raise ValueError(
                f"warmup_lr={self.warmup_lr} sets engine.optim's prelude (the warm-up's steps "
                f"at its rate), and the recipe sets engine.optim.{set_there[0]} too; drop one."
            )

    def actor_engine_config(self) -> dict[str, Any]:
        """``engine``, its optimizer's prelude the warm-up's steps at ``warmup_lr`` where that
        is set (RL then at ``engine.optim.lr``); without warm-up steps there is no prelude."""
        if self.warmup_lr is None or not self.warmup_sft_steps:
            return self.engine
        optim = {
            **(self.engine.get("optim") or {}),
            "prelude_steps": self.warmup_sft_steps,
            "prelude_lr": self.warmup_lr,
        }
        return {**self.engine, "optim": optim}

    def critic_engine_config(self) -> dict[str, Any]:
        if self.critic_engine is not None:
            return self.critic_engine
        return {**self.engine, "model": {**self.engine["model"], "value_head": True}}
